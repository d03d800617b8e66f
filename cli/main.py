"""Entry point: the `kvmem` click group. Library errors become a message + exit code."""

from __future__ import annotations

import sys

import click

from kvmem_llama import __version__
from kvmem_llama.cli import bench, build, chat, evaluate, generate, models, run, synth, vendor
from kvmem_llama.cli.console import fail
from kvmem_llama.errors import KvmemError

COMMAND_MODULES = (vendor, build, generate, models, synth, run, chat, evaluate, bench)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvmem")
def cli() -> None:
    """kvmem: run long-context GGUF models on your GPU with a tiered KV cache.

    The engine is llama.cpp (pinned) plus our patches: a small working set of the KV
    cache stays on the GPU, the whole history lives in host RAM, and the blocks that
    matter for each turn are brought back.

    \b
    First steps:
      kvmem build                 build the CPU engine (or --sm 90 for CUDA)
      kvmem generate "Hello"      generate text with the embedded default model
      kvmem chat                  chat with it in the terminal
      kvmem engines               list built engines
    """


for module in COMMAND_MODULES:
    for command in module.COMMANDS:
        cli.add_command(command)


def main() -> None:
    try:
        rv = cli.main(standalone_mode=False)
        if isinstance(rv, int):
            sys.exit(rv)
    except KvmemError as exc:
        fail(str(exc), exc.hint, exc.exit_code)
    except click.exceptions.Abort:
        fail("aborted", code=130)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
