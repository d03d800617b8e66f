"""Sessions kept across restarts (`kvmem run --keep-sessions`).

Every slot's context, the tiered history in the host pool included, is saved under the store when the server
stops and put back when a server for the same model starts again, through llama-server's slot save/restore
(`--slot-save-path`): with an engine that has `--kvmem-lazy-restore`, when the first request that continues it
arrives (the server then starts at once, and a session nobody continues is never read); else at start. The next
request then reads only its new tokens. The engine refuses a file that no longer
fits (another model, block size or KV type) with the reason, and the file stays where it is: `kvmem sessions`
lists and removes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmem_llama import paths
from kvmem_llama.serving import argv as server_argv
from kvmem_llama.serving import registry

SLOT_PREFIX = "slot-"
SLOT_SUFFIX = ".bin"
SAVE_TIMEOUT_S = 300.0  # a save waits for the slot's running request, then writes GBs for a long session


def root() -> Path:
    """Where kept sessions live: one folder per model id ($KVMEM_SESSIONS_DIR overrides)."""
    override = os.environ.get("KVMEM_SESSIONS_DIR")
    return Path(override).expanduser() if override else paths.home() / "sessions"


def session_dir(model_id: str) -> Path:
    return root() / registry.slug(model_id)


def slot_file(slot: int) -> str:
    return f"{SLOT_PREFIX}{slot}{SLOT_SUFFIX}"


def kept_dir(args: Sequence[str]) -> Path | None:
    """The sessions folder a server was started with (its --slot-save-path under root()), or None."""
    given = None
    for use in server_argv.scan_flags(args):
        if use.flag == "--slot-save-path":
            given = use.value
    if not given:
        return None
    folder = Path(str(given)).expanduser().resolve()
    return folder if folder.parent == root().expanduser().resolve() else None


def headers_of(record: registry.ServerRecord) -> dict[str, str]:
    """What a client of a registered server sends: its bearer token when it was started with --api-key."""
    return server_argv.bearer_headers(server_argv.api_key_from(record.argv))


@dataclass
class SlotResult:
    slot: int
    tokens: int = 0
    size: int = 0
    ms: float = 0.0
    error: str | None = None
    waiting: bool = False  # kept on disk until a request continues it (--kvmem-lazy-restore)

    def describe(self, verb: str) -> str:
        if self.error:
            return f"slot {self.slot}: not {verb}: {self.error}"
        mib = self.size / 2**20
        if self.waiting:
            return (f"slot {self.slot}: {self.tokens:,} tokens kept ({mib:,.1f} MiB), put back when a request "
                    "continues them")
        return f"slot {self.slot}: {verb} {self.tokens:,} tokens ({mib:,.1f} MiB) in {self.ms / 1000:.1f} s"


def _n_slots(url: str, headers: dict[str, str]) -> int:
    props = httpx.get(f"{url}/props", headers=headers, timeout=30).json()
    return int(props.get("total_slots") or 1)


def _slot_action(url: str, headers: dict[str, str], slot: int, action: str, filename: str) -> httpx.Response:
    return httpx.post(f"{url}/slots/{slot}", params={"action": action}, json={"filename": filename},
                      headers=headers, timeout=SAVE_TIMEOUT_S)


def _error(resp: httpx.Response) -> str:
    try:
        body = resp.json().get("error", {})
        return str(body.get("message") or body) if isinstance(body, dict) else str(body)
    except ValueError:
        return resp.text.strip() or f"HTTP {resp.status_code}"


def save_slots(url: str, headers: dict[str, str], folder: Path) -> list[SlotResult]:
    """Save every slot that holds a context into `folder` (the server's --slot-save-path). Each is written beside
    its kept file and replaces it only when it holds tokens: an empty slot (nothing asked yet, or a restore that
    was refused) never overwrites a session, nor does a slot whose kept session still waits for a request that
    continues it (--kvmem-lazy-restore: its file is that session). A save waits for the slot's running request."""
    results = []
    try:
        n_slots = _n_slots(url, headers)
    except (httpx.HTTPError, ValueError) as exc:
        return [SlotResult(0, error=f"the server does not answer: {exc}")]
    for slot in range(n_slots):
        if slot in {r.slot for r in waiting_slots(url, headers)}:  # asked again: a request may have taken it back
            continue
        fresh = folder / f"{SLOT_PREFIX}{slot}.new{SLOT_SUFFIX}"
        try:
            resp = _slot_action(url, headers, slot, "save", fresh.name)
            body = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            results.append(SlotResult(slot, error=f"{type(exc).__name__}: {exc}"))
            fresh.unlink(missing_ok=True)
            continue
        if resp.status_code != 200:
            results.append(SlotResult(slot, error=_error(resp)))
        elif body.get("n_saved"):
            fresh.replace(folder / slot_file(slot))
            results.append(SlotResult(slot, int(body["n_saved"]), int(body.get("n_written", 0)),
                                      float(body.get("timings", {}).get("save_ms", 0.0))))
        fresh.unlink(missing_ok=True)  # an empty slot: the kept file (if any) stays
    return results


def restore_slots(url: str, headers: dict[str, str], folder: Path) -> list[SlotResult]:
    """Put back every kept slot file of `folder` into its slot; a refused file stays for `kvmem sessions rm`."""
    results = []
    n_slots = _n_slots(url, headers)
    for session in sorted(list_dir(folder), key=lambda s: s.slot):
        if session.slot >= n_slots:
            results.append(SlotResult(session.slot, error=f"this server has {n_slots} slot(s) (--parallel)"))
            continue
        try:
            resp = _slot_action(url, headers, session.slot, "restore", slot_file(session.slot))
        except httpx.HTTPError as exc:
            results.append(SlotResult(session.slot, error=f"{type(exc).__name__}: {exc}"))
            continue
        if resp.status_code != 200:
            results.append(SlotResult(session.slot, error=_error(resp) + " (the server log says why)"))
            continue
        body = resp.json()
        results.append(SlotResult(session.slot, int(body.get("n_restored", 0)), int(body.get("n_read", 0)),
                                  float(body.get("timings", {}).get("restore_ms", 0.0))))
    return results


def waiting_slots(url: str, headers: dict[str, str]) -> list[SlotResult]:
    """The kept sessions a server started with --kvmem-lazy-restore holds back until a request continues them
    (none when the server does not show its slots)."""
    try:
        resp = httpx.get(f"{url}/slots", headers=headers, timeout=30)
        resp.raise_for_status()
        slots = resp.json()
    except (httpx.HTTPError, ValueError):
        return []
    results = []
    for slot in slots:
        kept = slot.get("kept_session")
        if kept:
            path = Path(kept.get("file", ""))
            size = path.stat().st_size if path.is_file() else 0
            results.append(SlotResult(int(slot["id"]), int(kept.get("n_tokens", 0)), size, waiting=True))
    return results


@dataclass
class KeptSession:
    model: str
    slot: int
    path: Path
    size: int
    saved_at: float

    def row(self) -> dict:
        return {"model": self.model, "slot": self.slot, "path": str(self.path), "bytes": self.size,
                "saved_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.saved_at))}


def list_dir(folder: Path) -> list[KeptSession]:
    out = []
    for path in sorted(folder.glob(f"{SLOT_PREFIX}*{SLOT_SUFFIX}")):
        number = path.name[len(SLOT_PREFIX):-len(SLOT_SUFFIX)]
        if number.isdigit():
            stat = path.stat()
            out.append(KeptSession(folder.name, int(number), path, stat.st_size, stat.st_mtime))
    return out


def list_sessions() -> list[KeptSession]:
    base = root()
    if not base.is_dir():
        return []
    return [s for folder in sorted(base.iterdir()) if folder.is_dir() for s in list_dir(folder)]


def remove_sessions(model: str | None) -> list[KeptSession]:
    """Delete the kept sessions of one model id (all of them when None); returns what was deleted."""
    doomed = [s for s in list_sessions() if model is None or s.model == registry.slug(model)]
    for session in doomed:
        session.path.unlink(missing_ok=True)
    folders = [root() / registry.slug(model)] if model else [f for f in root().glob("*") if f.is_dir()]
    for folder in folders:  # what a save killed part way left
        for stray in [*folder.glob(f"{SLOT_PREFIX}*.tmp"), *folder.glob(f"{SLOT_PREFIX}*.new{SLOT_SUFFIX}")]:
            stray.unlink(missing_ok=True)
    return doomed
