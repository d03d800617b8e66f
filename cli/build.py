"""`kvmem build` and `kvmem engines`."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvmem_llama import cpu_backend
from kvmem_llama.build import DEFAULT_FA_QUANTS, plan_build, run_build
from kvmem_llama.cli.console import console, human_bytes
from kvmem_llama.engine import Engine, engine_size, is_current, list_engines, lookup_engine, remove_engines
from kvmem_llama.errors import KvmemError
from kvmem_llama.packaging import SUMS_FILE, install_engine_package, package_engine


@click.command()
@click.option("--sm", metavar="SPEC",
              help="CUDA target(s): 75, 80, 86, 89, 90, 120 (=120a), a comma list, or `all` "
                   "(the six-SM matrix). Default: the CPU engine.")
@click.option("-j", "--jobs", type=click.IntRange(1, 512), help="Parallel compile jobs (default: all cores).")
@click.option("--dry-run", is_flag=True, help="Print the exact cmake commands and exit.")
@click.option("--force", is_flag=True, help="Rebuild even if this engine is already installed.")
@click.option("--upstream", is_flag=True,
              help="Build the pinned llama.cpp WITHOUT our patches (a baseline for A/B benchmarks).")
@click.option("--fa-quants", default=DEFAULT_FA_QUANTS, show_default=True,
              help="CUDA flash-attention K/V type pairs to compile: `engine` (f16, bf16, q8_0, q5_0 and q4_0 caches, "
                   "each K and V of one type: what kvmem run plans), `default` (upstream's set, no q5_0), `all` "
                   "(every pair, for mixed -ctk/-ctv such as q8_0/q5_0; the longest build), or pairs such as "
                   "`q8_0-q5_0,f16-f16`.")
@click.option("--ui/--no-ui", default=True, show_default=True,
              help="Embed llama-server's web UI, built from the pinned source with npm (skipped without npm).")
def build(sm: str | None, jobs: int | None, dry_run: bool, force: bool, upstream: bool, fa_quants: str,
          ui: bool) -> None:
    """Build an engine (llama-server, llama-cli, llama-bench, rpc-server, libllama).

    Fetches the pinned llama.cpp (verified), applies our patch series, builds with
    cmake (ccache when installed) and installs into the engine store. Results are
    cached by pin + patch hash + target + toolchain: a second run is instant.
    The web UI is built with npm from the pinned tree's tools/ui (cached by its hash)
    and embedded; nothing is fetched when the server runs.
    """
    plan = plan_build(sm, jobs, dry_run=dry_run, upstream=upstream, fa_quants=fa_quants, ui=ui)
    if dry_run:
        console.print(f"# engine {plan.key}")
        if plan.toolchain.note:
            console.print(f"# compiler: {plan.toolchain.note}", soft_wrap=True)
        console.print("# web UI: " + ("built with npm from tools/ui and embedded" if plan.ui
                                      else f"skipped: {plan.ui_skipped}"), soft_wrap=True)
        console.print(f"# source: {plan.src}  (pin {plan.pin.requirement} + {len(plan.series.names)} patch(es))")
        console.print(shlex.join(plan.configure_args()), soft_wrap=True)
        console.print(shlex.join(plan.build_args()), soft_wrap=True)
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("[dim]{task.fields[step]}"), console=console,
                  transient=True) as bar:
        task = bar.add_task(f"building {plan.target.name}", total=None, step="")

        def on_progress(done: int, total: int, step: str) -> None:
            bar.update(task, completed=done, total=total, step=step[-60:])

        engine, cached = run_build(plan, log=lambda m: bar.console.print(f"[dim]•[/] {m}"),
                                   progress=on_progress, force=force)
    if cached:
        console.print(f"[green]up to date[/] {engine.key} ({engine.path})")
    else:
        console.print(f"[green]built[/] {engine.key} in {engine.info['build_seconds']:.0f} s → {engine.path}")
    console.print(_ui_line(engine), soft_wrap=True)


def _ui_line(engine: Engine) -> str:
    ui = engine.info.get("ui") or {}
    if ui.get("embedded"):
        return f"web UI: embedded ({ui.get('files')} files): open the server's address in a browser"
    return f"web UI: not embedded ({ui.get('skipped') or 'built before kvmem embedded it'})"


def _engine_row(engine: Engine) -> dict:
    """What `kvmem engines` shows (and prints as JSON) for one engine."""
    pin = engine.info.get("pin", {})
    return {
        "key": engine.key,
        "target": engine.target,
        "sms": ",".join(engine.sms) or "-",
        "upstream": f"{pin.get('upstream_version', '?')} ({pin.get('upstream_commit', '?')})",
        "series": engine.info.get("series_hash", "?")[:10],
        "current": is_current(engine),
        "upstream_only": engine.upstream_only,
        "built_at": engine.info.get("built_at", "?"),
        "build_seconds": engine.info.get("build_seconds"),
        "size": engine_size(engine),
        "path": str(engine.path),
        "ui": bool((engine.info.get("ui") or {}).get("embedded")),
        "cpu_variants": engine.info.get("cpu_variants", []),
        "cpu_variant": cpu_backend.choose_variant(engine.path).chosen,  # the one ggml loads on this machine
    }


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.pass_context
def engines(ctx: click.Context, as_json: bool) -> None:
    """List the engines in the store with their build info (or install/package one)."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [_engine_row(e) for e in list_engines()]
    if as_json:
        console.print_json(data=rows)
        return
    if not rows:
        console.print("no engines yet: run [bold]kvmem build[/]")
        return
    table = Table(title="engines")
    for column in ("key", "target", "SMs", "CPU variant here", "upstream", "series", "built", "build s", "size"):
        table.add_column(column)
    for row in rows:
        mark = " [dim](upstream baseline)[/]" if row["upstream_only"] else (
            "" if row["current"] else " [yellow](old series)[/]")
        cpu = row["cpu_variant"] or ("-" if row["cpu_variants"] else "built in (not portable)")
        table.add_row(row["key"] + mark, row["target"], row["sms"], cpu, row["upstream"], row["series"],
                      row["built_at"], f"{row['build_seconds'] or 0:.0f}", human_bytes(row["size"]))
    console.print(table)


@engines.command("install")
@click.argument("package")
@click.option("--sums", metavar="PATH|URL", help="SHA256SUMS to verify against (default: next to the package).")
@click.option("--gpu-sm", metavar="SM", help="Check against this SM instead of the GPUs detected here.")
def engines_install(package: str, sums: str | None, gpu_sm: str | None) -> None:
    """Install an engine package (path or URL) after verifying it.

    The tarball's sha256 must match SHA256SUMS, every file must match its build-info
    sha256, and a CUDA engine must hold machine code for this GPU's SM.
    """
    engine = install_engine_package(package, sums, [gpu_sm.replace(".", "")] if gpu_sm else None)
    console.print(f"[green]installed[/] {engine.key} ({engine.target}) → {engine.path}")


@engines.command("rm")
@click.argument("keys", nargs=-1)
@click.option("--stale", is_flag=True, help="Also remove every engine built from an older patch series.")
def engines_rm(keys: tuple[str, ...], stale: bool) -> None:
    """Remove engines from the store."""
    if not keys and not stale:
        raise click.UsageError("name engine keys, or pass --stale")
    removed = remove_engines(list(keys), stale)
    console.print(f"removed {len(removed)} engine(s)" + "".join(f"\n  {k}" for k in removed))


@engines.command("package")
@click.argument("key", required=False)
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("dist"),
              show_default=True, help="Where the tarball and SHA256SUMS go.")
def engines_package(key: str | None, out_dir: Path) -> None:
    """Package an installed engine (default: the newest) as a tarball + SHA256SUMS."""
    engine = lookup_engine(key) if key else next(iter(list_engines()), None)
    if engine is None:
        raise KvmemError("no engines in the store", hint="build one with `kvmem build`")
    tarball = package_engine(engine, out_dir)
    console.print(f"[green]packaged[/] {tarball} ({human_bytes(tarball.stat().st_size)}); sums: {out_dir / SUMS_FILE}")


COMMANDS = [build, engines]
