"""The parent of a detached llama-server: it waits for the server and writes how it ended into the
server's registry record, so that `kvmem ps` can say "crashed (exit code -9, SIGKILL)" long after the
`kvmem run --detach` that started it has returned (only a process's parent learns its exit status).

    python -m kvmem_llama.serving.monitor --record RECORD.json --pid-fd N -- llama-server ARGS...

It starts the server in its own session (its output goes where the monitor's goes: the server log),
writes the server's pid to fd N (or "error: ..." when it cannot start it), passes SIGTERM, SIGINT and
SIGHUP on, waits, records `exit_code` and `ended_at` in the record when the record still names this
server, appends one line to the log, and ends the way the server ended (same code, same signal).
Standard library only: it stays resident as long as the server runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def record_exit(record: Path, pid: int, code: int) -> bool:
    """Write exit_code/ended_at into the record if it is still this server's (atomically)."""
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # stopped by `kvmem stop` (record removed), or never registered (a failed start)
    if data.get("pid") != pid:
        return False  # the name now belongs to another server
    data["exit_code"], data["ended_at"] = code, time.time()
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, record)
    return True


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmem-monitor")
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--pid-fd", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    with os.fdopen(args.pid_fd, "w") as pid_out:
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        except (OSError, IndexError) as exc:
            pid_out.write(f"error: {exc}")
            return 127
        pid_out.write(str(child.pid))
    code = child.wait()
    record_exit(args.record, child.pid, code)
    with contextlib.suppress(OSError):
        print(f"=== kvmem: llama-server (pid {child.pid}) {_describe(code)} at {time.strftime('%Y-%m-%d %H:%M:%S')}",
              flush=True)
    if code < 0:  # end the way the server ended, so that our parent (if still there) sees the same status
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP keep their default anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal that does not end a process
    return code


if __name__ == "__main__":
    sys.exit(main())
