"""`kvmem generate`: text from a GGUF through the cffi binding (no server)."""

from __future__ import annotations

from pathlib import Path

import click

from kvmem_llama.binding import Llama
from kvmem_llama.cli.console import console
from kvmem_llama.default_model import default_model_path


@click.command()
@click.argument("prompt")
@click.option("-m", "--model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="GGUF file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("-n", "--max-tokens", default=64, show_default=True, type=click.IntRange(1, 1 << 20))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 5),
              help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-c", "--ctx", "n_ctx", default=4096, show_default=True, type=click.IntRange(64))
def generate(prompt: str, model: Path | None, max_tokens: int, temperature: float, seed: int, n_ctx: int) -> None:
    """Generate a continuation of PROMPT with the CPU engine's libllama."""
    path = model or default_model_path()
    with Llama.load(path, n_ctx=n_ctx) as llm:
        stats: dict = {}
        console.print(f"[dim]{path.name} · {llm.describe()} · ctx {llm.n_ctx}[/]")
        console.print(prompt, end="")
        pieces: list[int] = []
        shown = ""
        for token in llm.stream(prompt, max_tokens, temperature=temperature, seed=seed, stats=stats):
            pieces.append(token)
            text = llm.detokenize(pieces)  # whole-text detokenize keeps multi-byte chars intact
            console.print(text[len(shown):], end="", markup=False)
            shown = text
        console.print()
        n = len(pieces)
        decode_s = stats.get("decode_ms", 0) / 1000
        console.print(f"[dim]prompt {stats.get('prompt_tokens', 0)} tok in {stats.get('prompt_ms', 0):.0f} ms · "
                      f"{n} tok at {n / decode_s if decode_s else 0:.1f} tok/s · stop: {stats.get('stop_reason')}[/]")


COMMANDS = [generate]
