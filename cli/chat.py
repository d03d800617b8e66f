"""`kvmem chat`: a conversation in the terminal with a server of `kvmem ps`, or one it starts."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from kvmem_llama import chat
from kvmem_llama.cli.console import err_console
from kvmem_llama.cli.run import LAUNCH_OPTION_NAMES, _print_warnings, _split_model, confirm_download, launch_options
from kvmem_llama.errors import KvmemError
from kvmem_llama.serving import launch

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ChatStopped(Exception):
    """SIGTERM or SIGHUP (terminal closed): leave the chat, stopping the server it started."""


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _show_error(exc: KvmemError) -> None:
    # soft wrap: the terminal folds long lines, so a path in the message stays one piece (copyable, searchable)
    err_console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
    if exc.hint:
        err_console.print(f"[yellow]hint:[/] {exc.hint}", soft_wrap=True)


class _Printer:
    """Prints an answer as it comes; reasoning (thinking models) dimmed, on a terminal only."""

    def __init__(self, show_reasoning: bool):
        self.show_reasoning = show_reasoning
        self.dimmed = False

    def stream(self, reply: chat.Reply) -> None:
        for piece in reply:
            if piece.kind == "reasoning":
                if self.show_reasoning:
                    _write(("" if self.dimmed else DIM) + piece.text)
                    self.dimmed = True
                continue
            if self.dimmed:
                self.end_reasoning("\n")
            _write(piece.text)
        self.end_reasoning()

    def end_reasoning(self, then: str = "") -> None:
        if self.dimmed:
            _write(RESET + then)
            self.dimmed = False


def _answer(session: chat.ChatSession, text: str, show_reasoning: bool) -> bool:
    """One answer; Ctrl-C stops it and keeps the session. False when it was interrupted."""
    reply = session.ask(text)
    printer = _Printer(show_reasoning)
    try:
        printer.stream(reply)
    except KeyboardInterrupt:
        reply.cancel()
        printer.end_reasoning()
        _write("\n")
        err_console.print("[dim]answer stopped (Ctrl-C); the chat goes on[/]")
        return False
    _write("\n")
    return True


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    def leave(signum: int, _frame) -> None:
        raise ChatStopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _repl(session: chat.ChatSession, interactive: bool, check_server: Callable[[], None]) -> None:
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())

    def read_line(prompt: str) -> str:
        return input(prompt if interactive else "")

    while True:
        try:
            text = chat.read_message(read_line)
        except KeyboardInterrupt:
            _write("\n")
            err_console.print("[dim](Ctrl-D or /bye quits)[/]")
            continue
        if text is None:  # Ctrl-D / end of input
            if interactive:
                _write("\n")
            return
        if not text.strip():
            continue
        if chat.is_command(text.strip()):
            try:
                result = session.command(text.strip())
            except KvmemError as exc:
                _show_error(exc)
                continue
            click.echo(result.text)
            if result.quit:
                return
            continue
        try:
            _answer(session, text, show_reasoning=sys.stdout.isatty())
        except KvmemError as exc:
            check_server()  # a server of ours that died ends the chat with its log
            _show_error(exc)


@click.command("chat", context_settings={"ignore_unknown_options": True})
@click.argument("target", required=False, metavar="[MODEL|SERVER-NAME]")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
@launch_options(default_port="auto")
@click.option("--once", metavar="PROMPT", help="Send PROMPT (`-` reads stdin), print the answer, exit.")
@click.option("-n", "--max-tokens", type=click.IntRange(1), help="Longest answer in tokens (default: no limit).")
@click.option("--system", "system_prompt", metavar="TEXT", help="System prompt (also /system TEXT).")
@click.option("--load", "load_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Start from a conversation saved with /save.")
def chat_cmd(target: str | None, server_args: tuple[str, ...], **opts) -> int:
    """Chat with a model in the terminal: a running server by name (`kvmem ps`), or MODEL started
    like `kvmem run` (same flags; stopped when the chat ends).

    \b
      kvmem chat                          the embedded SmolLM2
      kvmem chat qwen27b --ctk q5_0       start qwen27b as `kvmem run` would
      kvmem chat small                    attach to the server `kvmem run --name small` started
      kvmem chat --once "Say hi"          one answer on stdout, for scripts

    Answers stream as they are written; the conversation is kept. Enter sends; for several lines
    start and end with \"\"\" (or end lines with a backslash). Ctrl-C stops an answer, Ctrl-D or
    /bye quits. Commands: /clear, /save FILE, /load FILE, /system TEXT, /mode chat|tool, /stats, /help.
    """
    once: str | None = opts.pop("once")
    system_prompt: str | None = opts.pop("system_prompt")
    load_file: Path | None = opts.pop("load_file")
    max_tokens: int | None = opts.pop("max_tokens")
    model, extra = _split_model(target, server_args)
    conversation = chat.Conversation.load(load_file) if load_file else chat.Conversation()
    if system_prompt is not None:
        conversation.system = system_prompt or None
    if once == "-":
        once = sys.stdin.read()
    if once is not None and not once.strip():
        raise click.UsageError("--once needs a non-empty prompt")
    quiet = once is not None

    record = chat.attachable(model) if model else None
    handle = None
    with _stop_on_signals():
        try:
            if record is not None:
                context = click.get_current_context()
                given = {n: f"--{n.replace('_', '-')}" for n in LAUNCH_OPTION_NAMES
                         if context.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT}
                mode = opts["mode"] if given.pop("mode", None) else None  # else the server's own sampling
                if extra or given:
                    raise click.UsageError(f"{' '.join([*given.values(), *extra])}: server flags apply to a server "
                                           f"that kvmem chat starts; {record.name!r} is already running")
                client = chat.ChatClient.for_record(record)
                if not quiet:
                    err_console.print(f"[dim]attached to {record.name} ({record.url}, model {record.model_id})[/]")
            else:
                handle = _start(model, extra, opts, quiet)
                client = chat.ChatClient(handle.url, handle.model_id, handle.log_path)
                mode = opts["mode"]
            session = chat.ChatSession(client, conversation, mode, max_tokens)
            try:
                if once is not None:
                    return 0 if _answer(session, once, show_reasoning=False) else 130
                err_console.print("[dim]/help for commands, Ctrl-D or /bye quits[/]")
                _repl(session, interactive=sys.stdin.isatty(), check_server=lambda: _check_alive(handle))
            finally:
                client.close()
            _check_alive(handle)
            return 0
        except ChatStopped:
            return 143
        finally:
            if handle is not None:
                handle.stop()
                if not quiet:
                    err_console.print(f"[dim]stopped {handle.name}[/]")


def _check_alive(handle: launch.ServerHandle | None) -> None:
    if handle is not None and handle.returncode() is not None:
        raise handle.failed(f"llama-server exited with code {handle.returncode()} during the chat")


def _start(model: str | None, extra: list[str], opts: dict, quiet: bool) -> launch.ServerHandle:
    lp = launch.prepare(model, extra_args=extra, ctx=opts["ctx"], port=opts["port"], host=opts["host"],
                        mode=opts["mode"], ctk=opts["ctk"], ctv=opts["ctv"], engine=opts["engine"], rpc=opts["rpc"],
                        pull=True, confirm=confirm_download(opts["yes"]), draft_mtp=opts["draft_mtp"],
                        mmproj=opts["mmproj"])
    if not quiet:
        _print_warnings(lp.notes, lp.plan.fixes)
        err_console.print(f"[dim]starting {lp.model_id} on engine {lp.engine.key}…[/]")
    handle = launch.launch(lp, name=opts["name"])
    try:
        handle.wait_ready(opts["timeout"], expect_ctx=lp.ctx, self_test=lp.self_test,
                          on_status=None if quiet else (lambda msg: err_console.print(f"[dim]kvmem: {msg}[/]")))
    except BaseException:
        handle.stop()
        raise
    if not quiet:
        budget = f"{handle.budget:,}" if handle.budget else "off"
        ui = launch.web_ui_url(handle.url)
        err_console.print(f"[bold green]ready[/] {handle.url}  model [bold]{handle.model_id}[/]  ctx "
                          f"{handle.ctx or '?'}  budget {budget}  log {handle.log_path}"
                          + (f"  web UI {ui}" if ui else ""), soft_wrap=True, highlight=False)
    return handle


COMMANDS = [chat_cmd]
