"""`kvmem bench`: long-context serving benchmark (one configuration per call) and its report."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import click

from kvmem_llama import plots
from kvmem_llama.bench import BenchResult, append_results, cells, load_results, markdown_table, plot, ratios, run_cell
from kvmem_llama.cli.console import console
from kvmem_llama.engine import lookup_engine


@click.group(invoke_without_command=True)
@click.option("--engine", help="Engine key (prefix) or directory.")
@click.option("-m", "--model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--config", "config", help="Label of this configuration (e.g. upstream, tiering-off, tiering-on).")
@click.option("--contexts", default="4096,32768", show_default=True, help="Comma list of logical contexts.")
@click.option("--gen", "gen_tokens", default=1024, show_default=True,
              help="Tokens generated in turn 2 (decode tok/s over all of them, re-selections included).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100),
              help="Repeats of turn 2 per (config, context): the turn-1 prefix + 512 new random tokens (other "
                   "ones each repeat) + --gen tokens, all on one server after one prefill (its prompt cache keeps "
                   "the prefix, so each repeat reads only the 512 new tokens). The report gives min and median.")
@click.option("--fresh-servers", is_flag=True,
              help="Start a fresh server, and so a fresh turn-1 prefill, for every repeat: independent prefill "
                   "repeats, at the cost of a full prefill each.")
@click.option("--server-args", default="", help="Extra llama-server flags for this configuration (one string).")
@click.option("--image", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Start turn 1 with this image (PNG/JPEG; needs --mmproj in --server-args): text fills the "
                   "context after it and turn 2 decodes after it at depth. Rows add the image's tokens and the "
                   "server's ms to encode and to decode it.")
@click.option("--image-at", default=0, show_default=True, type=click.IntRange(0),
              help="Tokens of text before the image in turn 1 (0: the image opens the conversation, in the sink "
                   "block that never leaves the working set; past the sink and the recent window it can be evicted "
                   "and retrieved).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
              show_default=True)
@click.pass_context
def bench(ctx: click.Context, engine: str | None, model: Path | None, config: str | None, contexts: str,
          gen_tokens: int, repeats: int, fresh_servers: bool, server_args: str, image: Path | None,
          image_at: int, out_dir: Path) -> None:
    """Measure prefill/decode speed, VRAM, host RSS and selection time at long contexts.

    Per context one server: turn 1 fills the context (prefill tok/s, once); then each repeat is a turn 2
    on the same prefix with 512 new tokens, generating --gen tokens at that depth (decode tok/s, with
    every re-selection of a tiered engine inside it, and each one's ms, from that repeat's part of the
    server log). One result row per repeat; prefill is one value per server (--fresh-servers: one server
    per repeat). Run once per configuration (same --out), then `kvmem bench report --out DIR`.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not (engine and model and config):
        raise click.UsageError("--engine, --model and --config are required")
    server = lookup_engine(engine).server
    args = shlex.split(server_args)
    if image_at and image is None:
        raise click.UsageError("--image-at places an --image: give one")
    if image is not None and "--mmproj" not in args:
        raise click.UsageError("--image needs the model's vision projector: add --mmproj FILE to --server-args")
    image_bytes = image.read_bytes() if image is not None else None
    for context in [int(c) for c in contexts.split(",") if c.strip()]:
        results: list[BenchResult] = []

        def record(result: BenchResult, context: int = context, results: list[BenchResult] = results) -> None:
            results.append(result)
            append_results(out_dir / "results.jsonl", [result])
            refresh = f", {len(result.refresh_ms)} re-selections" if result.refresh_ms else ""
            shared = " (shared)" if result.prefill_shared else ""
            if result.image_tokens:
                shared += (f", image {result.image_tokens} tokens: encoded {result.image_encode_ms or 0:.0f} ms, "
                           f"decoded {result.image_decode_ms or 0:.0f} ms")
            status = f"[red]{result.error[:200]}[/]" if result.error else (
                f"prefill {result.prefill_tps:.0f} tok/s{shared}, turn 2 read {result.turn2_prompt_tokens} tokens, "
                f"decode {result.decode_tps:.1f} tok/s over {result.decode_tokens} tokens{refresh}, "
                f"KV {result.kv_buffer_mib:.0f} MiB, peak VRAM {result.peak_vram_mib or 0:.0f} MiB")
            console.print(f"  {config} @ {context:,} repeat {result.repeat + 1}/{repeats}: {status}")

        if fresh_servers:
            for repeat in range(repeats):
                console.print(f"[dim]•[/] {config} @ {context:,} tokens, server {repeat + 1}/{repeats}: "
                              "turn 1 + turn 2 …")
                run_cell(server, model, config, context, args, out_dir / "logs", gen_tokens, 1,
                         first_repeat=repeat, image=image_bytes, image_at=image_at, on_result=record)
        else:
            console.print(f"[dim]•[/] {config} @ {context:,} tokens: one server, turn 1 + {repeats} repeats of "
                          "turn 2 …")
            run_cell(server, model, config, context, args, out_dir / "logs", gen_tokens, repeats, image=image_bytes,
                     image_at=image_at, on_result=record)
        ok = [r.decode_tps for r in results if not r.error]
        console.print(f"  {config} @ {context:,}: {len(ok)}/{repeats} repeats" + (
            f", decode median {statistics.median(ok):.1f} tok/s" if ok else ""))


@bench.command()
@click.option("--out", "out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--baseline", default="upstream", show_default=True, help="Configuration the ratios divide by.")
def report(out_dir: Path, baseline: str) -> None:
    """Write results.md, cells.json (min/median per cell), ratios.json and decode_vs_context.png."""
    rows = load_results(out_dir / "results.jsonl")
    table = markdown_table(rows)
    (out_dir / "results.md").write_text(table, encoding="utf-8")
    (out_dir / "cells.json").write_text(json.dumps(cells(rows), indent=2), encoding="utf-8")
    rel = ratios(rows, baseline)
    (out_dir / "ratios.json").write_text(json.dumps(rel, indent=2), encoding="utf-8")
    console.print(table)
    if plots.available():
        plot(rows, out_dir / "decode_vs_context.png")
    else:
        console.print(plots.skipped("decode_vs_context.png"), style="yellow", markup=False, soft_wrap=True)
    for r in rel:
        console.print(f"{r['config']} @ {r['context']:,}: decode ×{r['decode_vs_baseline']}, "
                      f"prefill ×{r['prefill_vs_baseline']}, KV ×{r['kv_buffer_vs_baseline']}")


COMMANDS = [bench]
