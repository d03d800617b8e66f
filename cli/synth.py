"""`kvmem synth`: write a synthetic GGUF (random weights, real donor tokenizer) of a given arch and shape."""

from __future__ import annotations

from pathlib import Path

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from kvmem_llama import synth, synth_vision
from kvmem_llama.cli.console import console, human_bytes
from kvmem_llama.errors import KvmemError


def _shape_table(plan: synth.SynthPlan) -> Table:
    s = plan.shape
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    layers = f"{s.n_layer}"
    if s.arch == "qwen35":
        layers += (f" ({len(s.attention_layers)} full attention, every {s.full_attention_interval}th; "
                   f"{s.n_layer - len(s.attention_layers)} gated delta-net)")
    table.add_row("arch", s.arch + (" + MTP block" if s.mtp else ""))
    table.add_row("layers", layers)
    table.add_row("embd / ffn", f"{s.n_embd} / {s.n_ff}")
    table.add_row("heads", f"{s.n_head} q, {s.n_head_kv} kv, head_dim {s.head_dim}, rope dims {s.n_rot}")
    if s.arch == "qwen35":
        table.add_row("delta-net", f"{s.ssm_group_count} k heads, {s.ssm_time_step_rank} v heads, "
                                   f"dim {s.ssm_state_size}, conv {s.ssm_conv_kernel}")
    table.add_row("vocab", f"{plan.n_vocab} (tokenizer from {s.donor})")
    params = f"{plan.n_params / 1e9:.3f} B" if plan.n_params >= 1e9 else f"{plan.n_params / 1e6:.1f} M"
    table.add_row("tensors", f"{len(plan.tensors)}, {params} parameters")
    table.add_row("data", human_bytes(plan.data_bytes) + "  ("
                  + ", ".join(f"{k} {human_bytes(v)}" for k, v in plan.bytes_by_type().items()) + ")")
    return table


@click.command("synth")
@click.option("--arch", type=click.Choice(synth.ARCHS), default=None,
              help="Model architecture (default: the preset's only arch; `tiny` needs one).")
@click.option("--preset", type=click.Choice(list(synth.PRESETS)), default="tiny", show_default=True,
              help="tiny: a few MB for CPU tests; qwen35-27b: the Qwen3.8-27B shape (~15 GB).")
@click.option("--mtp", is_flag=True, help="Add the MTP (nextn) block, for --spec-type draft-mtp (qwen35 only).")
@click.option("--quant", type=click.Choice(list(synth.QUANTS)), default="q4_k", show_default=True,
              help="Type of the weight matrices (rows too short for q4_k fall back to q4_0).")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
              help="Same seed, same shape: byte-identical file.")
@click.option("--donor", default=None, metavar="NAME|PATH",
              help="GGUF whose tokenizer is copied: a shipped model name or a path (default: per arch).")
@click.option("--layers", "n_layer", type=click.IntRange(1, 512), default=None,
              help="Override the number of trunk layers (e.g. a truncated 27B for quick checks).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output .gguf file.")
@click.option("--threads", type=click.IntRange(1, 64), default=None,
              help="Threads generating weights (default: cores - 1, at most 8).")
@click.option("--mmproj", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a vision projector (qwen3vl_merger, random weights) for this model to this "
                   "file, for `kvmem run --mmproj` (qwen35 only; tiny: a few hundred KB, qwen35-27b: ~0.9 GB).")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--dry-run", is_flag=True, help="Print the shape and size; write nothing.")
def synth_cmd(arch: str | None, preset: str, mtp: bool, quant: str, seed: int, donor: str | None,
              n_layer: int | None, output: Path | None, mmproj: Path | None, threads: int | None, force: bool,
              dry_run: bool) -> None:
    """Write a synthetic GGUF: random (valid, finite) weights and a real tokenizer.

    For tests and benchmarks of archs no registry package ships, e.g. the hybrid
    qwen35 (gated delta-net + full attention every 4th layer) with its MTP head.

    \b
    Examples:
      kvmem synth --arch qwen35 --preset tiny --mtp -o tiny-qwen35-mtp.gguf
      kvmem synth --preset qwen35-27b --quant q4_k -o qwen35-27b.gguf
      kvmem synth --arch qwen35 --preset tiny -o tiny-qwen35.gguf --mmproj tiny-mmproj.gguf
      kvmem synth --preset qwen35-27b --dry-run
    """
    if not dry_run:
        if output is None:
            raise click.UsageError("missing -o/--output (or pass --dry-run)")
        for path in (output, mmproj):
            if path is not None and path.exists() and not force:  # before the (slow) donor read
                raise KvmemError(f"{path} already exists", hint="pass --force to overwrite it")
    plan = synth.plan_for(arch, preset, mtp=mtp, quant=quant, donor=donor, n_layer=n_layer)
    if mmproj is not None and plan.shape.arch != "qwen35":
        raise KvmemError(f"--mmproj: the synthetic vision projector is for qwen35 models, not {plan.shape.arch}",
                         hint="add --arch qwen35")
    console.print(_shape_table(plan))
    if mmproj is not None:
        vision = synth_vision.PRESETS[preset]
        console.print(f"[dim]vision projector[/] qwen3vl_merger {preset}: {vision.n_layer} blocks of "
                      f"{vision.n_embd}, patch {vision.patch_size}, 2x2 merge into {plan.shape.n_embd}")
    if dry_run:
        return

    columns = (TextColumn("{task.description}", style="dim"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("metadata", total=plan.data_bytes)

        def on_progress(done: int, total: int, name: str) -> None:
            progress.update(task, completed=done, description=f"{name:<32}")

        result = synth.write_synthetic(plan, output, seed=seed, preset=preset, force=force,
                                       progress=on_progress, threads=threads)
    console.print(f"[green]wrote[/] {result.path} · {human_bytes(result.file_bytes)} in {result.seconds:.1f} s "
                  f"({result.mb_per_s:.0f} MB/s)")
    if mmproj is not None:
        path = synth_vision.synthesize_mmproj(mmproj, text_n_embd=plan.shape.n_embd, preset=preset, seed=seed,
                                              force=force)
        console.print(f"[green]wrote[/] {path} · {human_bytes(path.stat().st_size)} (vision projector)")


COMMANDS = [synth_cmd]
