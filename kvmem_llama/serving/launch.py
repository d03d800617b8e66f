"""Launch llama-server the way `kvmem run` does: the model resolved, the engine for this GPU, argv
from plan < sampling profile < user flags, a registered name with a log file, and readiness that
means "answers correctly", not "listens".

Library use (the eval harness does this):

    with start_server("smollm2", ctx=4096) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="-").chat.completions.create(model=srv.model_id, ...)
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmem_llama import hardware, paths, planner
from kvmem_llama.engine import Engine, select_engine
from kvmem_llama.errors import KvmemError
from kvmem_llama.models import ResolvedModel, resolve_model, vision_projector
from kvmem_llama.models.gguf_info import model_info
from kvmem_llama.serving import argv, readiness, registry, sessions
from kvmem_llama.serving.process import LOOPBACK, ServerProcess, free_port, port_in_use

DEFAULT_HOST = LOOPBACK
DEFAULT_PORT = 8080


def pick_port(host: str, port: int | str | None) -> int:
    """The port to listen on: a number that must be free, `auto` (a free one), or the default."""
    if port in (None, ""):
        port = DEFAULT_PORT
    if str(port) == "auto":
        return free_port(host)
    try:
        number = int(port)
    except ValueError:
        raise KvmemError(f"invalid port {port!r}", hint="a number, or --port auto") from None
    if port_in_use(host, number):
        owner = registry.owner_of_port(number)
        who = f" by kvmem server {owner!r}" if owner else ""
        hint = f"kvmem stop {owner}, or " if owner else ""
        raise KvmemError(f"port {number} on {host} is already in use{who}", hint=f"{hint}pass --port auto or --port N")
    return number


@dataclass
class LaunchPlan:
    """Everything decided before the process starts (what `kvmem run --dry-run` prints)."""

    model: ResolvedModel
    engine: Engine
    hardware: hardware.Hardware
    plan: planner.Plan
    argv: list[str]
    host: str
    port: int
    model_id: str
    ctx: int | None
    budget: int
    tiering: bool
    self_test: bool
    notes: list[str]
    mmproj: Path | None = None  # the vision projector the server loads


def prepare(model: str | None = None, *, extra_args: Sequence[str] = (), ctx: int | None = None,
            port: int | str | None = None, host: str = DEFAULT_HOST, mode: str = "chat",
            ctk: str | None = None, ctv: str | None = None, engine: str | None = None,
            rpc: str | None = None, hw: hardware.Hardware | None = None, pull: bool = False,
            confirm: Callable[[str], bool] | None = None, self_test: bool = True,
            draft_mtp: bool | None = None, keep_sessions: bool = False, mmproj: str | None = None) -> LaunchPlan:
    """Resolve model + engine, plan memory and build the argv: plan < profile < user flags.

    `keep_sessions`: the server saves its slots under the store (serving.sessions) and restores them.
    `mmproj`: the vision projector, a path or `none` (default: the one the model's catalog entry names, when
    pulled)."""
    argv.refuse_download_flags(extra_args)
    resolved = resolve_model(model, pull=pull, confirm=confirm)
    hw = hw or hardware.detect()
    chosen = select_engine(hw, engine)
    if not chosen.server.exists():
        raise KvmemError(f"engine {chosen.key} has no llama-server binary", hint="kvmem build --force")
    help_text = argv.engine_help(chosen)
    on_gpu = bool(chosen.sms)
    plan_hw = hw if on_gpu else dataclasses.replace(hw, gpus=[])
    notes: list[str] = []
    gpu = plan_hw.gpu()
    recommended = resolved.profile_for(gpu.vram_total / planner.GiB) if gpu is not None else None
    if recommended and not (ctk or ctv):  # the catalog's tested KV types for this VRAM tier
        ctk, ctv = recommended.get("ctk"), recommended.get("ctv")
        notes.append(f"catalog profile for {recommended.get('min_vram_gib')}+ GiB: -ctk {ctk} -ctv {ctv}")
    user = list(extra_args)
    given = argv.user_flags(user)
    projector, note = vision_projector(resolved, str(given.get("-mm") or mmproj or ""))
    if note:
        notes.append(note)
    plan = planner.plan(model_info(resolved.path), plan_hw, ctx=ctx, ctk=ctk, ctv=ctv, draft_mtp=draft_mtp,
                        label=resolved.name, mmproj_bytes=projector.stat().st_size if projector else 0,
                        mmproj_offload="--no-mmproj-offload" not in given)
    notes += plan.warnings
    profile, tiering, budget, why = argv.decide_tiering(plan.profile, help_text, given)
    notes += why
    host = str(given.get("--host") or host)
    port_num = pick_port(host, given.get("--port") or port)
    exposed = readiness.exposure_warning(host, port_num, argv.api_key_from(user))
    if exposed:
        notes.append(exposed)
    model_id = (given.get("-a") or resolved.alias or registry.slug(resolved.path.stem)).split(",")[0].strip()
    # with --rpc, layers go to the RPC devices
    base = argv.profile_args(profile, help_text, tiering, on_gpu or bool(rpc))
    ours = ["-m", str(resolved.path), "--alias", model_id, "--host", host, "--port", str(port_num)]
    if argv.supports(help_text, "--strict-model-id"):
        ours.append("--strict-model-id")
    if rpc:
        ours += ["--rpc", rpc]
    if projector is not None:
        ours += ["--mmproj", str(projector)]
    if tiering and argv.supports(help_text, "--kvmem-disk-path"):  # the user's --kvmem-disk-* replace these
        disk_dir = paths.kv_disk_dir()
        disk_dir.mkdir(parents=True, exist_ok=True)
        user_mib = str(given.get("--kvmem-host-mib") or "")
        host_mib = int(user_mib) if user_mib.isdigit() else profile.host_mib
        disk, note = argv.disk_tier_args(host_mib, disk_dir, shutil.disk_usage(disk_dir).free)
        ours += disk
        if note:
            notes.append(note)
    if keep_sessions:
        folder = sessions.session_dir(model_id)
        folder.mkdir(parents=True, exist_ok=True)
        ours += ["--slot-save-path", str(folder)]
        if argv.supports(help_text, "--kvmem-lazy-restore") and "--no-slots" not in user:  # it lists them there
            ours.append("--kvmem-lazy-restore")  # each session comes back with the first request continuing it
    command = [str(chosen.server), *argv.merge_args(base + ours, argv.sampling_args(mode), user)]
    if on_gpu and (missing := argv.missing_fa_kernels(chosen.info.get("fa_quants"), command, tiering)):
        sm = ",".join(chosen.sms)
        raise KvmemError(missing, hint=f"use -ctk/-ctv of one type (f16, q8_0, q5_0), or build an engine with every "
                                       f"pair: kvmem build --sm {sm} --fa-quants all")
    crowded = argv.parallel_tiering_warning(command, budget, argv.kvmem_defaults(help_text)) if tiering else None
    if crowded:
        notes.append(crowded)
    user_ctx = given.get("-c")
    run_ctx = int(user_ctx) if user_ctx and str(user_ctx).isdigit() else profile.ctx
    if run_ctx == 0:
        run_ctx = None  # "0 = from the model": take what the server reports
    return LaunchPlan(resolved, chosen, hw, plan, command, host, port_num, model_id, run_ctx, budget, tiering,
                      self_test and tiering and budget > 0, notes, projector)


@dataclass
class ServerHandle(ServerProcess):
    """A server started by `launch`: registered under `name` (`kvmem ps`) until it is stopped."""

    name: str = ""
    model_path: Path | None = None
    engine: Engine | None = None
    detached: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Stop the server and forget its record; a server that was ready and ended on its own keeps its
        record with the exit code (`kvmem ps` shows it as crashed)."""
        ended_on_its_own = self.ready and self.returncode() is not None
        code = super().stop(timeout)
        record = registry.load(self.name)
        if record is not None and record.pid == self.pid:
            if ended_on_its_own:
                registry.mark_exited(self.name, record.pid, code)
            else:
                registry.remove(self.name)
        return code


def launch(lp: LaunchPlan, *, name: str | None = None, detach: bool = False,
           on_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None) -> ServerHandle:
    """Start the planned server with its output going to its log file (appended, never lost). A detached
    server runs under serving.monitor, which records its exit code once this process is gone."""
    name = registry.check_name(name) if name else registry.unique_name(lp.model_id)
    existing = registry.load(name)
    if existing is not None and existing.alive:
        raise KvmemError(f"a server named {name!r} is already running (pid {existing.pid}, port {existing.port})",
                         hint=f"kvmem stop {name}, or pick another --name")
    log_path = registry.log_path(name)
    banner = f"=== kvmem: starting {name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(lp.argv)}"
    handle = ServerHandle.spawn(lp.argv, log_path, host=lp.host, port=lp.port, append=True, banner=banner, env=env,
                                on_line=on_line, model_id=lp.model_id, ctx=lp.ctx, budget=lp.budget, name=name,
                                model_path=lp.model.path, engine=lp.engine, detached=detach, notes=list(lp.notes),
                                monitor_record=registry.record_path(name) if detach else None)
    assert handle.pid is not None and handle.process is not None
    registry.save(registry.ServerRecord(name, handle.pid, lp.host, lp.port, lp.model_id, str(lp.model.path), lp.ctx,
                                        lp.budget, str(log_path), lp.argv, lp.engine.key, detach,
                                        create_time=registry.process_start_time(handle.pid),
                                        monitor_pid=handle.process.pid if detach else None))
    return handle


def web_ui_url(url: str, timeout: float = 5.0) -> str | None:
    """`URL/` when the server serves its built-in web UI there, else None (an engine built without
    the UI, or --no-ui, answers 404)."""
    try:
        resp = httpx.get(url.rstrip("/") + "/", timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return None
    ok = resp.status_code == 200 and "text/html" in resp.headers.get("content-type", "")
    return url.rstrip("/") + "/" if ok else None


def start_server(model: str | None = None, *, extra_args: Sequence[str] = (), ctx: int | None = None,
                 port: int | str | None = None, ready_timeout: float = 120.0, name: str | None = None,
                 mode: str = "chat", host: str = DEFAULT_HOST, detach: bool = False,
                 on_line: Callable[[str], None] | None = None, **prepare_kw) -> ServerHandle:
    """Start a ready llama-server (library API). Stop it with `.stop()` or use it as a context manager.

    `port` None picks a free one. Raises ServerFailed (with the last log lines) if the server exits
    or is not ready within `ready_timeout` seconds; the process is stopped then. `prepare_kw` goes to
    prepare(): ctk, ctv, engine, rpc, hw, pull, confirm, self_test (False skips the tiering needle test).
    """
    lp = prepare(model, extra_args=extra_args, ctx=ctx, port="auto" if port is None else port, host=host,
                 mode=mode, **prepare_kw)
    handle = launch(lp, name=name, detach=detach, on_line=on_line)
    try:
        handle.wait_ready(ready_timeout, expect_ctx=lp.ctx, self_test=lp.self_test)
    except BaseException:
        handle.stop()
        raise
    return handle
