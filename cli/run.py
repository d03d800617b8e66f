"""`kvmem plan`, `run`, `serve`, `ps`, `stop`, `logs`, `doctor`, `rpc-server`."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import click
from rich.markup import escape
from rich.table import Table

from kvmem_llama import doctor, hardware, planner
from kvmem_llama.cli.console import console, err_console, human_bytes
from kvmem_llama.engine import select_engine
from kvmem_llama.errors import KvmemError
from kvmem_llama.models.gguf_info import CACHE_TYPES as KV_TYPES
from kvmem_llama.serving import argv, launch, process, registry, sessions

CACHE_TYPES = click.Choice(sorted(KV_TYPES))


def _plan_table(plan: planner.Plan) -> Table:
    prof = plan.profile
    table = Table(title=f"plan for {plan.label} ({plan.model.arch}) on the {prof.device.upper()}",
                  show_header=True, header_style="bold")
    table.add_column("item")
    table.add_column("size", justify="right")
    table.add_column("note", style="dim")
    for item, size, note in plan.ledger:
        table.add_row(item, human_bytes(size) if size is not None else "-", note)
    return table


def _profile_table(plan: planner.Plan) -> Table:
    prof = plan.profile
    info = plan.model
    table = Table(title="profile", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    table.add_row("context", f"{prof.ctx:,} tokens (trained: {info.native_ctx or 0:,})")
    table.add_row("KV per token", f"{plan.kv_per_token.get(prof.ctk, 0):,} B at {prof.ctk}; "
                  f"{info.n_attention_layers} of {info.n_layers} layers hold KV "
                  f"({info.n_kv_heads} KV heads x {info.head_dim_k} dims)")
    table.add_row("cache types", f"-ctk {prof.ctk} -ctv {prof.ctv}")
    table.add_row("kvmem budget", f"{prof.budget:,} tokens on the GPU (gen reserve {prof.gen_reserve:,}, "
                  f"host pool {prof.host_mib:,} MiB)" if prof.budget else "0 (tiering off: the whole KV fits)")
    table.add_row("draft-mtp", "on" if prof.draft_mtp else "off")
    if prof.n_gpu_layers is not None:
        table.add_row("GPU layers", f"{prof.n_gpu_layers} of {info.n_layers}")
    return table


def _print_warnings(lines: list[str], fixes: list[str] | None = None) -> None:
    for line in lines:
        err_console.print(f"[yellow]warning:[/] {line}")
    for i, fix in enumerate(fixes or [], 1):
        err_console.print(f"  [yellow]{i}.[/] {fix}")


@click.command("plan")
@click.argument("model", required=False)
@click.option("--vram", metavar="SIZE", help="Plan for this much VRAM (e.g. 16G) instead of the detected GPU; 0 = CPU.")
@click.option("--ram", metavar="SIZE", help="Plan for this much available host RAM (e.g. 64G).")
@click.option("--ctx", type=click.IntRange(256), help="Logical context in tokens (default: the model's trained one).")
@click.option("--ctk", type=CACHE_TYPES, help="K cache type (default: f16, quantized only when needed).")
@click.option("--ctv", type=CACHE_TYPES, help="V cache type (default: same as --ctk).")
@click.option("--gpu", "gpu_index", type=click.IntRange(0), default=0, show_default=True, help="GPU index.")
@click.option("--draft-mtp/--no-draft-mtp", default=None, help="Force the MTP draft on/off (default: when it fits).")
@click.option("--mmproj", metavar="FILE|none", default="",
              help="Vision projector to count (default: the pulled one the model's catalog entry names).")
@click.option("--no-mmproj-offload", is_flag=True, help="Plan the vision projector in RAM instead of VRAM.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_cmd(model: str | None, vram: str | None, ram: str | None, ctx: int | None, ctk: str | None,
             ctv: str | None, gpu_index: int, draft_mtp: bool | None, mmproj: str, no_mmproj_offload: bool,
             as_json: bool) -> None:
    """Plan memory for MODEL on this machine: weights, KV per token, working set, host pool.

    Reads the GGUF header and the hardware (NVML, psutil) and picks a profile: context,
    --kvmem-budget, gen reserve, KV cache types, host pool size and the MTP draft.
    A hub model (alias or OWNER/REPO:FILE.gguf) that is not downloaded yet is planned
    from its header alone, read with HTTP Range requests and cached.
    """
    hw = hardware.detect(vram, ram, gpu_index)
    result = planner.plan_model(model, hw, mmproj=mmproj, ctx=ctx, ctk=ctk, ctv=ctv, draft_mtp=draft_mtp,
                                gpu_index=gpu_index, mmproj_offload=not no_mmproj_offload)
    if as_json:
        data = result.to_dict()
        data["hardware"] = hw.to_dict()
        click.echo(json.dumps(data, indent=2))
        return
    if not hw.has_gpu:
        why = f" ({hw.nvml_error})" if hw.nvml_error and vram is None else ""
        console.print(f"[dim]no GPU{why}: planning a CPU run with {human_bytes(hw.ram_available)} of RAM available[/]")
    console.print(_plan_table(result))
    console.print(_profile_table(result))
    _print_warnings(result.warnings, result.fixes)
    if result.not_downloaded:
        remote = result.not_downloaded
        how = "cached" if remote["cached"] else f"{human_bytes(remote['fetched_bytes'])} read over HTTP"
        console.print(f"[yellow]{result.label}: not downloaded yet ({remote['size'] / 1e9:.1f} GB)[/]: planned from "
                      f"its GGUF header ({how}); `kvmem pull {model}` downloads {remote['repo']}:{remote['file']}",
                      soft_wrap=True)


def _split_model(model: str | None, server_args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    # `kvmem run -- -c 4096`: click hands the first token after -- to MODEL
    if model is not None and model.startswith("-"):
        return None, [model, *server_args]
    return model, list(server_args)


def launch_options(default_port: str) -> Callable[[Callable], Callable]:
    """The options of a command that starts a server the way `kvmem run` does (run, chat)."""
    options = [
        click.option("--ctx", type=click.IntRange(256), help="Context in tokens (default: from the plan)."),
        click.option("--ctk", type=CACHE_TYPES, help="K cache type (default: from the plan)."),
        click.option("--ctv", type=CACHE_TYPES, help="V cache type (default: same as --ctk)."),
        click.option("--mode", type=click.Choice(sorted(argv.SAMPLING_PROFILES)), default="chat", show_default=True,
                     help="Sampling defaults: chat (temp 0.7, top-p 0.9, top-k 20) or tool (temp 0.2, top-p 0.8, "
                          "top-k 20, presence 0.05: agents stop repeating failed calls)."),
        click.option("--port", default=default_port, show_default=True, help="Port, or `auto` for a free one."),
        click.option("--host", default=launch.DEFAULT_HOST, show_default=True, help="Address to listen on."),
        click.option("--name", help="Server name for ps/stop/logs (default: the model id)."),
        click.option("--engine", help="Engine key from `kvmem engines`, or `cpu` (default: the one for your GPU)."),
        click.option("--rpc", metavar="HOST:PORT,...",
                     help="Offload to llama.cpp rpc-server(s) (see `kvmem rpc-server`)."),
        click.option("--draft-mtp/--no-draft-mtp", default=None,
                     help="Speculative decoding with the model's MTP head (default: on when the model has one and "
                          "it fits)."),
        click.option("--timeout", type=click.FloatRange(1), default=300, show_default=True,
                     help="Readiness timeout, s."),
        click.option("--yes", "-y", is_flag=True, help="Download a missing model without asking."),
        click.option("--mmproj", metavar="FILE|none",
                     help="Vision projector (mmproj GGUF) for image input (default: the one the model's catalog "
                          "entry names, pulled with it). Images work with KV tiering on."),
    ]

    def apply(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


LAUNCH_OPTION_NAMES = ("ctx", "ctk", "ctv", "mode", "port", "host", "name", "engine", "rpc", "draft_mtp", "timeout",
                       "yes", "mmproj")


def confirm_download(yes: bool) -> Callable[[str], bool]:
    return lambda message: yes or click.confirm(message, default=True, err=True)


def _print_slots(verb: str, results: list[sessions.SlotResult], name: str | None = None) -> None:
    prefix = f"{name}: " if name else ""
    for result in results:
        colour = "yellow" if result.error else "green"
        console.print(f"[{colour}]{prefix}{result.describe(verb)}[/]", soft_wrap=True)


def print_web_ui(url: str) -> None:
    ui = launch.web_ui_url(url)
    if ui:
        console.print(f"web UI {ui}", soft_wrap=True)
    else:
        console.print(f"[dim]no web UI at {url}/ (this engine was built without it, or --no-ui was given)[/]",
                      soft_wrap=True)


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("model", required=False)
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
@launch_options(default_port=str(launch.DEFAULT_PORT))
@click.option("--detach", "-d", is_flag=True, help="Run in the background (own session); see `kvmem ps`.")
@click.option("--quiet", "-q", is_flag=True, help="Do not echo the server log to the console.")
@click.option("--dry-run", is_flag=True, help="Print the plan and the llama-server command, start nothing.")
@click.option("--keep-sessions", is_flag=True,
              help="Save every slot's context (the tiered history too) under the store when the server stops, and "
                   "put it back when it starts again with this model: a long conversation resumes without reading "
                   "it again. Uses disk: ~the host KV pool per slot (see `kvmem sessions`).")
def run_cmd(model: str | None, server_args: tuple[str, ...], ctx: int | None, ctk: str | None, ctv: str | None,
            mode: str, port: str, host: str, name: str | None, detach: bool, engine: str | None, rpc: str | None,
            draft_mtp: bool | None, timeout: float, yes: bool, mmproj: str | None, quiet: bool, dry_run: bool,
            keep_sessions: bool) -> int:
    """Run MODEL (default: the embedded SmolLM2) as an OpenAI-compatible server and wait until it is ready.

    The engine matches your GPU (or the CPU), the plan fits your VRAM and RAM, and every
    llama-server flag after `--` passes through and wins over the plan:

    \b
      kvmem run qwen27b --ctk q5_0
      kvmem run model.gguf --mode tool --port auto -- --parallel 2 -c 16384
      kvmem run smollm2 --detach --name small && kvmem ps

    Ready means: /health ok, /v1/models serves the model id and context, and (with KV
    tiering on) a needle prompt longer than the GPU budget is answered correctly.
    """
    model, extra = _split_model(model, server_args)
    lp = launch.prepare(model, extra_args=extra, ctx=ctx, port=port, host=host, mode=mode, ctk=ctk, ctv=ctv,
                        engine=engine, rpc=rpc, pull=True, confirm=confirm_download(yes), draft_mtp=draft_mtp,
                        keep_sessions=keep_sessions, mmproj=mmproj)
    _print_warnings(lp.notes, lp.plan.fixes)
    if dry_run:
        console.print(f"engine {lp.engine.key}; model id {lp.model_id}; tiering {'on' if lp.tiering else 'off'}")
        click.echo(shlex.join(lp.argv))
        return 0

    def echo(line: str) -> None:
        # straight to fd 1: this thread never holds sys.stdout's buffer lock, which the main thread
        # could then wait on without being interruptible by Ctrl-C
        data = (line + "\n").encode("utf-8", errors="replace")
        while data:
            try:
                data = data[os.write(1, data):]
            except BlockingIOError:
                time.sleep(0.01)
            except OSError:
                return  # console gone (closed pipe): the log file still has every line

    handle = launch.launch(lp, name=name, detach=detach, on_line=None if (quiet or detach) else echo)

    def on_sigterm(_signum, _frame) -> None:
        raise KeyboardInterrupt  # stop the server the same way as Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    ready = False
    try:
        handle.wait_ready(timeout, expect_ctx=lp.ctx, self_test=lp.self_test,
                          on_status=lambda msg: err_console.print(f"[dim]kvmem: {msg}[/]"))
        ready = True
        budget = f"{handle.budget:,}" if handle.budget else "off"
        console.print(f"[bold green]ready[/] {handle.url}  model [bold]{handle.model_id}[/]  "
                      f"ctx {handle.ctx or '?'}  budget {budget}  log {handle.log_path}", soft_wrap=True)
        if handle.self_test:
            console.print(f"[green]self-test:[/] {handle.self_test}", soft_wrap=True)
        print_web_ui(handle.url)
        kept = sessions.kept_dir(lp.argv)
        if kept is not None and "--kvmem-lazy-restore" in lp.argv:
            _print_slots("kept", sessions.waiting_slots(handle.url, handle.headers))
        elif kept is not None:
            _print_slots("restored", sessions.restore_slots(handle.url, handle.headers, kept))
        if detach:
            console.print(f"detached as [bold]{handle.name}[/] (pid {handle.pid}): "
                          f"`kvmem logs {handle.name} -f`, `kvmem stop {handle.name}`", soft_wrap=True)
            return 0
        code = handle.wait()
    except KeyboardInterrupt:
        kept = sessions.kept_dir(lp.argv) if ready else None
        try:
            if kept is not None:
                err_console.print("[dim]kvmem: saving the sessions (after any running request; Ctrl-C again "
                                  "stops without them)[/]")
                _print_slots("saved", sessions.save_slots(handle.url, handle.headers, kept))
        except KeyboardInterrupt:
            err_console.print("[yellow]kvmem: sessions not saved (interrupted)[/]")
        finally:
            err_console.print("[dim]kvmem: stopping the server[/]")
            code = handle.stop()
        err_console.print(f"[dim]kvmem: {process.describe_stop(handle.stop_result)} (exit code {code})[/]")
        return 0 if ready else 130
    except BaseException:
        code = handle.stop()  # not ready (ServerFailed carries the log) or our own bug: never leave it behind
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    handle.stop()
    raise handle.failed(f"llama-server {process.describe_exit(code)}; `kvmem ps` lists it until "
                        f"`kvmem stop {handle.name}`")


@click.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": []})
@click.pass_context
def serve_cmd(ctx: click.Context) -> None:
    """Drop-in llama-server: every argument goes to the engine's llama-server unchanged.

    `kvmem serve --help` prints llama-server's own help; the exit code is llama-server's.
    """
    argv.refuse_download_flags(ctx.args)
    hw = hardware.detect()
    engine = select_engine(hw, os.environ.get("KVMEM_ENGINE") or None)
    command = [str(engine.server), *ctx.args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)  # same pid, signals and exit code as running llama-server directly


@click.command("rpc-server", context_settings={"ignore_unknown_options": True})
@click.option("--host", "-H", default="127.0.0.1", show_default=True,
              help="Address to listen on (RPC is unauthenticated: expose it only on a trusted network).")
@click.option("--port", "-p", type=click.IntRange(1, 65535), default=50052, show_default=True, help="Port.")
@click.option("--engine", help="Engine key (default: the one for your GPU, else the CPU engine).")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def rpc_server_cmd(host: str, port: int, engine: str | None, extra: tuple[str, ...]) -> None:
    """Start llama.cpp's rpc-server so another host's `kvmem run --rpc HOST:PORT` can use this machine.

    Extra arguments after `--` go to rpc-server (e.g. `-- -c` to cache tensors locally).
    """
    chosen = select_engine(hardware.detect(), engine)
    binary = chosen.binary("rpc-server")
    if not binary.exists():
        raise KvmemError(f"engine {chosen.key} has no rpc-server", hint="kvmem build --force")
    if process.port_in_use(host, port):
        raise KvmemError(f"port {port} on {host} is already in use", hint="pass --port N")
    command = [str(binary), "-H", host, "-p", str(port), *extra]
    err_console.print(f"[dim]kvmem: {shlex.join(command)}[/]")
    sys.stdout.flush()
    os.execv(command[0], command)


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _status_cell(state: str, status: str) -> str:
    color = {"running": "green", "exited": "yellow"}.get(state, "red")
    return f"[{color}]{escape(status)}[/]"


@click.command("ps")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ps_cmd(as_json: bool) -> None:
    """List servers started by `kvmem run`: running ones, and those that ended without `kvmem stop` with
    their exit code (e.g. "crashed (exit code -9, SIGKILL)"; `kvmem logs NAME` still has the log,
    `kvmem stop NAME` forgets them). `kept`: the disk its sessions take (`--keep-sessions`)."""
    kept = {}  # name -> bytes of the sessions kept for it (kvmem run --keep-sessions)
    for record in registry.list_records():
        folder = sessions.kept_dir(record.argv)
        kept[record.name] = sum(s.size for s in sessions.list_dir(folder)) if folder else None
    rows = [{**asdict(status), "kept_sessions_bytes": kept.get(status.name)} for status in registry.statuses()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("no servers (start one with `kvmem run --detach`)")
        return
    table = Table(show_header=True, header_style="bold")
    for col in ("name", "pid", "port", "model", "ctx", "budget", "uptime", "RSS", "VRAM", "kept", "status"):
        table.add_column(col, justify="right" if col in ("pid", "port", "ctx", "budget", "RSS", "VRAM", "kept")
                         else "left")
    for row in rows:
        table.add_row(row["name"], str(row["pid"]), str(row["port"]), row["model"], str(row["ctx"] or "-"),
                      f"{row['budget']:,}" if row["budget"] else "off", _uptime(row["uptime_s"]),
                      human_bytes(row["rss"]), human_bytes(row["vram"]),
                      "-" if row["kept_sessions_bytes"] is None else human_bytes(row["kept_sessions_bytes"]),
                      _status_cell(row["state"], row["status"]) + ("" if row["detached"] else " (fg)"))
    console.print(table)


@click.command("stop")
@click.argument("names", nargs=-1)
@click.option("--all", "stop_all", is_flag=True, help="Stop every server in `kvmem ps`.")
@click.option("--timeout", type=click.FloatRange(0), default=15, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
def stop_cmd(names: tuple[str, ...], stop_all: bool, timeout: float) -> None:
    """Stop servers by name (SIGTERM, then SIGKILL after --timeout)."""
    if not names and not stop_all:
        raise click.UsageError("name a server (see `kvmem ps`) or pass --all")
    records = registry.list_records() if stop_all else [registry.require(n) for n in names]
    if not records:
        console.print("no servers to stop")
    for record in records:
        kept = sessions.kept_dir(record.argv) if record.alive else None
        try:
            if kept is not None:
                _print_slots("saved", sessions.save_slots(record.url, sessions.headers_of(record), kept), record.name)
        finally:
            result = registry.stop(record, timeout)
        console.print(f"{record.name}: {process.describe_stop(result)}")


@click.command("logs")
@click.argument("name")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the server exits (or Ctrl-C).")
@click.option("--lines", "-n", type=click.IntRange(0), default=None, help="Only the last N lines.")
def logs_cmd(name: str, follow: bool, lines: int | None) -> None:
    """Print a server's log (llama-server's stdout and stderr)."""
    path = registry.log_file(name)
    start = 0
    if lines is not None:
        for line in process.tail_lines(path, lines):
            click.echo(line)
        start = path.stat().st_size
    elif not follow:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                click.echo(line, nl=False)
    if not follow:
        return

    last = registry.load(name)

    def running() -> bool:  # until the server exits; a log without a server: until Ctrl-C
        nonlocal last
        last = registry.load(name) or last
        return last is None or last.alive

    with contextlib.suppress(KeyboardInterrupt):
        process.follow_log_while(path, click.echo, start, running)


@click.command("doctor")
@click.argument("model", required=False)
@click.option("--port", type=click.IntRange(1, 65535), default=launch.DEFAULT_PORT, show_default=True,
              help="Port that `kvmem run` would use.")
@click.option("--ctx", type=click.IntRange(256), help="Context to check the host pool for.")
@click.option("--engine", help="Engine key to check (default: the one `kvmem run` would pick).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def doctor_cmd(model: str | None, port: int, ctx: int | None, engine: str | None, as_json: bool) -> int:
    """Check what usually breaks a launch: GPU architecture vs engine, model format, checksum,
    non-ASCII paths, RAM for the host pool, port, driver/CUDA. Exits 1 on any failure."""
    checks = doctor.run_checks(model, port=port, ctx=ctx, engine=engine)
    if as_json:
        click.echo(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        table = Table(show_header=True, header_style="bold")
        table.add_column("check")
        table.add_column("status")
        table.add_column("detail")
        table.add_column("fix", style="yellow")
        style = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}
        for check in checks:
            table.add_row(check.name, style[check.status], check.detail, check.fix or "")
        console.print(table)
    failed = [c for c in checks if c.status == "fail"]
    if failed and not as_json:
        err_console.print(f"[bold red]{len(failed)} check(s) failed[/]")
    return 1 if failed else 0


@click.group("sessions")
def sessions_group() -> None:
    """Sessions kept by `kvmem run --keep-sessions`: one file per slot and model, under the store."""


@sessions_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def sessions_list_cmd(as_json: bool) -> None:
    """Kept sessions: model, slot, size on disk, when saved."""
    rows = [s.row() for s in sessions.list_sessions()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print(f"no kept sessions in {sessions.root()}", soft_wrap=True)
        return
    table = Table(box=None)
    for column in ("model", "slot", "size", "saved", "file"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["model"], str(row["slot"]), human_bytes(row["bytes"]), row["saved_at"], row["path"])
    console.print(table)


@sessions_group.command("rm")
@click.argument("model", required=False)
@click.option("--all", "remove_all", is_flag=True, help="Remove every kept session.")
def sessions_rm_cmd(model: str | None, remove_all: bool) -> None:
    """Remove the kept sessions of MODEL (its id, as `kvmem sessions list` shows it), or --all."""
    if not model and not remove_all:
        raise click.UsageError("name a model (see `kvmem sessions list`) or pass --all")
    removed = sessions.remove_sessions(None if remove_all else model)
    if not removed and model:
        raise KvmemError(f"no kept sessions for {model!r}", hint="kvmem sessions list")
    freed = sum(s.size for s in removed)
    console.print(f"removed {len(removed)} session file(s), {human_bytes(freed)}")


COMMANDS = [plan_cmd, run_cmd, serve_cmd, ps_cmd, stop_cmd, logs_cmd, doctor_cmd, rpc_server_cmd, sessions_group]
