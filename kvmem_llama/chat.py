"""Chat with a llama-server over its OpenAI-compatible API: what `kvmem chat` drives.

- `Conversation`: the system prompt and the turns; saved and loaded as JSON;
- `ChatClient`: streams one answer (`Reply`, cancellable mid-answer) and reads the server's KV
  tiering state (/props, /slots, /metrics when enabled, the last `kvmem_score: SELECT` in its log);
- `ChatSession`: a conversation on a client, the sampling mode and the slash commands;
- `read_message`: multi-line input (a `\"\"\"` block, or lines ending with a backslash).

    client = ChatClient("http://127.0.0.1:8080", "smollm2")
    session = ChatSession(client)
    reply = session.ask("Hello")
    for piece in reply:
        print(piece.text, end="")

One module (~500 lines) on purpose: the session's slash commands reach into the conversation and
the client, and the three are only used together; the CLI (cli/chat.py) only parses and prints.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmem_llama import kvmem_log
from kvmem_llama.errors import KvmemError
from kvmem_llama.files import atomic_write_text
from kvmem_llama.serving import argv, registry
from kvmem_llama.serving.process import tail_lines

ROLES = ("system", "user", "assistant")
# llama-server flag of a sampling profile -> the request field that overrides it per request
SAMPLING_FIELDS = {"--temp": "temperature", "--top-p": "top_p", "--top-k": "top_k",
                   "--presence-penalty": "presence_penalty"}
MULTILINE_FENCE = '"""'
START_BANNER = "=== kvmem: starting "  # launch() writes it before each run of a named server
EXIT_COMMANDS = ("/bye", "/exit", "/quit")
HELP = """\
/clear            forget the conversation (the system prompt stays)
/save FILE        write the conversation to FILE (JSON)
/load FILE        replace the conversation with FILE's
/system TEXT      set the system prompt (/system alone removes it)
/mode chat|tool   sampling: chat (temp 0.7) or tool (temp 0.2, presence 0.05)
/stats            KV working set vs host pool, the last SELECT, tokens per second
/image FILE       send an image (PNG, JPEG, GIF, BMP) with your next message; the server needs a
                  vision projector (kvmem run MODEL --mmproj FILE); /image alone drops the waiting ones
/bye              quit (also Ctrl-D on an empty line)
Multi-line input: start and end with \"\"\", or end lines with a backslash.
Ctrl-C stops the answer being written, not the chat."""


# what an image file starts with -> its media type (the formats llama-server's image decoder reads)
IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"), (b"BM", "image/bmp"))
MAX_IMAGE_BYTES = 20 << 20


def image_part(path: Path) -> dict:
    """An OpenAI `image_url` content part (a base64 data URI) for an image file, or a KvmemError saying why not."""
    import base64

    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise KvmemError(f"{path} is {size / 2**20:.1f} MiB: images up to {MAX_IMAGE_BYTES >> 20} MiB go in a "
                             "request", hint="scale it down first (the model sees at most a few megapixels)")
        data = path.read_bytes()
    except IsADirectoryError:
        raise KvmemError(f"{path} is a directory, not an image file") from None
    except OSError as exc:
        raise KvmemError(f"cannot read {path}: {exc.strerror or exc}") from None
    mime = next((m for magic, m in IMAGE_MAGIC if data.startswith(magic)), None)
    if mime is None:
        raise KvmemError(f"{path} is not a PNG, JPEG, GIF or BMP image",
                         hint="convert it to PNG or JPEG (llama-server's image decoder reads those)")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def _valid_content(content: object) -> bool:
    """A message's content: text, or a list of text and image_url parts (what the OpenAI API takes)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and (p.get("type") == "text" and isinstance(p.get("text"), str)
                                 or p.get("type") == "image_url" and isinstance(p.get("image_url"), dict)
                                 and isinstance(p["image_url"].get("url"), str))
        for p in content)


def sampling_params(mode: str) -> dict[str, float]:
    """The request fields of a sampling profile (`kvmem run --mode`), so /mode works on any server."""
    try:
        profile = argv.SAMPLING_PROFILES[mode]
    except KeyError:
        raise KvmemError(f"unknown mode {mode!r}", hint=f"one of: {', '.join(argv.SAMPLING_PROFILES)}") from None
    return {SAMPLING_FIELDS[flag]: value for flag, value in profile.items()}


# --- the conversation ---


@dataclass
class Conversation:
    system: str | None = None
    # user and assistant messages, in order; a user message with images has a list of parts as its content
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.turns]

    def add(self, user: str | list[dict], assistant: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

    def clear(self) -> None:
        self.turns.clear()

    def to_json(self) -> dict:
        return {"format": "kvmem-chat/1", "messages": self.messages()}

    @classmethod
    def from_json(cls, data: object, source: str = "the file") -> Conversation:
        """A conversation from `{"messages": [...]}` (or a bare list of messages), checked message by message."""
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list):
            raise KvmemError(f"{source} has no list of messages",
                             hint='expected {"messages": [{"role": "user", "content": "..."}, ...]}')
        conv = cls()
        for i, msg in enumerate(messages):
            if not (isinstance(msg, dict) and msg.get("role") in ROLES and _valid_content(msg.get("content"))
                    and (msg["role"] == "user" or isinstance(msg["content"], str))):
                raise KvmemError(f"message {i + 1} of {source} is not a {{role, content}} pair with role "
                                 f"{'/'.join(ROLES)}: {json.dumps(msg)[:120]}")
            if msg["role"] == "system":
                conv.system = msg["content"]
            else:
                conv.turns.append({"role": msg["role"], "content": msg["content"]})
        return conv

    def save(self, path: Path) -> Path:
        try:
            return atomic_write_text(path, json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n")
        except OSError as exc:
            raise KvmemError(f"cannot write {path}: {exc.strerror or exc}") from None

    @classmethod
    def load(cls, path: Path) -> Conversation:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KvmemError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KvmemError(f"{path} is not JSON: {exc}") from None
        return cls.from_json(data, str(path))


# --- one streamed answer ---


@dataclass
class Piece:
    kind: str  # "content" (the answer) or "reasoning" (a thinking model's reasoning_content)
    text: str


@dataclass
class TurnStats:
    """One answer as the server timed it (the client's own clock when it was interrupted)."""

    completion_tokens: int = 0
    decode_tps: float | None = None
    prompt_tokens: int | None = None  # the whole prompt, history included
    cached_tokens: int | None = None  # of those, reused from the server's KV cache
    prompt_tps: float | None = None
    seconds: float = 0.0
    interrupted: bool = False


def _server_error(resp: httpx.Response) -> KvmemError:
    try:
        error = resp.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = None
    hint = ("this server has no vision projector: start it with one (kvmem run MODEL --mmproj FILE), or /image "
            "alone and /clear to go on without the image" if message and "mmproj" in message else None)
    return KvmemError(f"the server answered HTTP {resp.status_code}: {message or resp.text[:300]}", hint=hint)


class Reply:
    """A streamed answer: iterate for its pieces; `cancel()` stops it (the server stops generating)."""

    def __init__(self, http: httpx.Client, body: dict, on_end: Callable[[Reply], None] | None = None):
        self._http = http
        self._body = body
        self._on_end = on_end
        self._response: httpx.Response | None = None
        self._ended = False
        self.text = ""
        self.reasoning = ""
        self.stats = TurnStats()

    def __iter__(self) -> Iterator[Piece]:
        started = time.monotonic()
        first: float | None = None
        pieces = 0
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=self._body) as resp:
                self._response = resp
                if resp.status_code != 200:
                    resp.read()
                    raise _server_error(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ":" keep-alive pings
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        error = chunk["error"]
                        raise KvmemError(f"the server stopped the answer: "
                                         f"{error.get('message') if isinstance(error, dict) else error}")
                    self._read_totals(chunk)
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
                            text = delta.get(key)
                            if text:
                                first = first or time.monotonic()
                                pieces += 1
                                if kind == "content":
                                    self.text += text
                                else:
                                    self.reasoning += text
                                yield Piece(kind, text)
        except httpx.HTTPError as exc:
            if not self.stats.interrupted:
                raise KvmemError(f"lost the server at {self._http.base_url}: {exc}",
                                 hint="is it still running? `kvmem ps`, `kvmem logs NAME`") from None
        finally:
            self.stats.seconds = time.monotonic() - started
            if self.stats.decode_tps is None and first is not None:
                # no server timings (interrupted): one streamed piece is about one token
                self.stats.completion_tokens = self.stats.completion_tokens or pieces
                elapsed = time.monotonic() - first
                self.stats.decode_tps = pieces / elapsed if elapsed > 0 else None
        self._end()

    def _read_totals(self, chunk: dict) -> None:
        usage = chunk.get("usage") or {}
        timings = chunk.get("timings") or {}
        if usage:
            self.stats.prompt_tokens = usage.get("prompt_tokens")
            self.stats.completion_tokens = usage.get("completion_tokens") or 0
            self.stats.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if timings:
            self.stats.decode_tps = timings.get("predicted_per_second")
            self.stats.prompt_tps = timings.get("prompt_per_second")
            self.stats.completion_tokens = timings.get("predicted_n") or self.stats.completion_tokens

    def cancel(self) -> None:
        """Stop the answer: closing the connection makes llama-server stop the task. Safe to call twice."""
        self.stats.interrupted = True
        if self._response is not None:
            self._response.close()
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            if self._on_end is not None:
                self._on_end(self)


# --- the server's side: tiering state ---


def _prometheus(text: str) -> dict[str, float]:
    """`llamacpp:NAME value` lines of /metrics as {NAME: value}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^llamacpp:(\w+)(?:\{[^}]*\})?\s+(\S+)", line)
        if match:
            try:
                values[match[1]] = float(match[2])
            except ValueError:
                pass
    return values


def last_select(log_path: Path | None, max_lines: int = 20000) -> dict | None:
    """The last `kvmem_score: SELECT` of the server's current run (its log may hold earlier runs)."""
    if log_path is None:
        return None
    found = None
    for line in tail_lines(log_path, max_lines):
        if line.startswith(START_BANNER):
            found = None  # an earlier run of this name
        elif (select := kvmem_log.parse_select(line)) is not None:
            found = select
    return found


@dataclass
class ServerStats:
    """KV tiering as the server reports it: /props (config), /slots (per slot), /metrics (when enabled)."""

    model_id: str
    url: str
    tiering: dict = field(default_factory=dict)  # /props kvmem: enabled, budget, block, ...
    slots: list[dict] = field(default_factory=list)  # /slots: id, n_ctx, is_processing, kvmem {...}
    metrics: dict[str, float] = field(default_factory=dict)  # /metrics kvmem_* (empty without --metrics)
    last_select: dict | None = None

    @property
    def tiering_on(self) -> bool:
        return bool(self.tiering.get("enabled"))

    def blocks(self, key: str) -> int:
        return sum(int((s.get("kvmem") or {}).get(key, 0)) for s in self.slots)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def describe(stats: ServerStats, turn: TurnStats | None, mode: str | None, messages: int) -> list[str]:
    """The /stats lines: the session, the last answer's speed, working set vs host pool, the last SELECT."""
    sampling = f"{mode} profile" if mode else "the server's defaults"
    lines = [f"model {stats.model_id} at {stats.url} · sampling: {sampling} · {messages} messages"]
    if turn is None:
        lines.append("last answer: none yet")
    else:
        speed = f" at {turn.decode_tps:.1f} tok/s" if turn.decode_tps else ""
        prompt = ""
        if turn.prompt_tokens is not None:
            cached = f" ({turn.cached_tokens:,} from cache)" if turn.cached_tokens is not None else ""
            prompt_speed = f" at {turn.prompt_tps:.1f} tok/s" if turn.prompt_tps else ""
            prompt = f"; prompt {turn.prompt_tokens:,} tokens{cached}{prompt_speed}"
        stopped = " (interrupted)" if turn.interrupted else ""
        lines.append(f"last answer: {turn.completion_tokens:,} tokens{speed}{prompt}{stopped}")
    if not stats.tiering_on:
        lines.append("KV tiering: off (the whole KV cache stays in the working set)")
        return lines
    block = int(stats.tiering.get("block") or 0)
    budget = int(stats.tiering.get("budget") or 0)
    gpu = int(stats.metrics.get("kvmem_blocks_gpu", stats.blocks("blocks_gpu")))
    host = int(stats.metrics.get("kvmem_blocks_host", stats.blocks("blocks_host")))
    host_bytes = stats.metrics.get("kvmem_host_bytes", stats.blocks("host_bytes"))
    lines.append(f"working set: {gpu:,} blocks = {gpu * block:,} tokens of a {budget:,}-token budget "
                 f"({block}-token blocks, method {stats.tiering.get('method')})")
    capacity = stats.metrics.get("kvmem_host_capacity_bytes")
    lines.append(f"host pool: {host:,} blocks = {host * block:,} tokens, {_mib(host_bytes)}"
                 + (f" of {_mib(capacity)}" if capacity else ""))
    disk = int(stats.metrics.get("kvmem_blocks_disk", stats.blocks("blocks_disk")))
    if disk or stats.tiering.get("disk_path"):
        disk_bytes = stats.metrics.get("kvmem_disk_bytes", stats.blocks("disk_bytes"))
        lines.append(f"disk tier: {disk:,} blocks = {disk * block:,} tokens, {_mib(disk_bytes)} under "
                     f"{stats.tiering.get('disk_path') or '?'} (idle conversations' blocks, back when they continue)")
    busy = [s for s in stats.slots if any((s.get("kvmem") or {}).get(k) for k in ("blocks_host", "blocks_disk"))]
    if len(busy) > 1:
        lines += [f"  slot {s.get('id')}: {s['kvmem'].get('blocks_gpu', 0)} in the working set, "
                  f"{s['kvmem'].get('blocks_host', 0)} in the host pool"
                  + (f", {s['kvmem']['blocks_disk']} on disk" if s["kvmem"].get("blocks_disk") else "") for s in busy]
    selections = sum(int((s.get("kvmem") or {}).get("selections", 0)) for s in stats.slots)
    sel = stats.last_select
    if sel is not None:  # the server's log line (a server on this machine)
        lines.append(f"last SELECT ({selections} so far): seq {sel['seq']} reason={sel.get('reason', '?')} "
                     f"n_blocks={sel['n_blocks']} budget_blocks={sel['budget_blocks']} scored={sel['scored']} "
                     f"staged_in={sel['staged_in']} staged_out={sel['staged_out']} reused={sel['reused']} "
                     f"ms={sel['ms']:g}")
    else:
        last_ms = max((float((s.get("kvmem") or {}).get("last_select_ms", 0)) for s in stats.slots), default=0.0)
        lines.append(f"last SELECT ({selections} so far)" + (f": {last_ms:g} ms" if selections else ": none yet"))
    return lines


class ChatClient:
    """One llama-server's chat API and state endpoints; `log_path` (optional) is read for SELECT lines."""

    def __init__(self, url: str, model_id: str, log_path: Path | None = None):
        self.url = url.rstrip("/")
        self.model_id = model_id
        self.log_path = log_path
        # no read timeout: a long prompt's prefill may take minutes; Ctrl-C is the way out
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(10.0, read=None), trust_env=False)

    @classmethod
    def for_record(cls, record: registry.ServerRecord) -> ChatClient:
        return cls(record.url, record.model_id, Path(record.log_path))

    def reply(self, messages: list[dict], params: dict | None = None,
              on_end: Callable[[Reply], None] | None = None) -> Reply:
        """Stream the answer to `messages`; `params` are request fields (sampling, max_tokens)."""
        body = {"model": self.model_id, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **(params or {})}
        return Reply(self.http, body, on_end)

    def _get(self, path: str) -> httpx.Response:
        try:
            return self.http.get(path)
        except httpx.HTTPError as exc:
            raise KvmemError(f"cannot reach the server at {self.url}: {exc}",
                             hint="is it still running? `kvmem ps`") from None

    def server_stats(self) -> ServerStats:
        stats = ServerStats(self.model_id, self.url, last_select=last_select(self.log_path))
        props = self._get("/props")
        if props.status_code == 200:
            stats.tiering = props.json().get("kvmem") or {}
        slots = self._get("/slots")
        if slots.status_code == 200:
            stats.slots = slots.json()
        metrics = self._get("/metrics")  # 501 unless the server runs with --metrics
        if metrics.status_code == 200:
            stats.metrics = {k: v for k, v in _prometheus(metrics.text).items() if k.startswith("kvmem_")}
        return stats

    def close(self) -> None:
        self.http.close()


def attachable(name: str) -> registry.ServerRecord | None:
    """The live server of `kvmem ps` with this name, if one is (else `name` is a model to start)."""
    try:
        record = registry.load(registry.check_name(name))
    except KvmemError:
        return None  # not a server name (e.g. a path or OWNER/REPO:FILE)
    return record if record is not None and record.alive else None


# --- the session: conversation + client + slash commands ---


@dataclass
class CommandResult:
    text: str
    quit: bool = False


class ChatSession:
    """A conversation on a server. `ask` streams an answer; `command` runs a slash command."""

    def __init__(self, client: ChatClient, conversation: Conversation | None = None, mode: str | None = None,
                 max_tokens: int | None = None):
        self.client = client
        self.conversation = conversation or Conversation()
        self.mode = mode
        self.max_tokens = max_tokens  # None: until the model stops (or the context is full)
        if mode is not None:
            sampling_params(mode)  # an unknown mode fails here, not at the first answer
        self.last_turn: TurnStats | None = None
        self.images: list[dict] = []  # image parts waiting for the next message (/image)

    def ask(self, text: str) -> Reply:
        """Stream the answer to `text` (with the images /image attached). The turn joins the conversation when
        the answer ends or is cancelled with some text; an interrupted answer stays as far as it was shown."""
        content: str | list[dict] = [{"type": "text", "text": text}, *self.images] if self.images else text
        messages = self.conversation.messages() + [{"role": "user", "content": content}]

        def ended(reply: Reply) -> None:
            self.last_turn = reply.stats
            if reply.text or not reply.stats.interrupted:
                self.conversation.add(content, reply.text)
                self.images = []  # they are in the conversation now (and go with every later turn)

        params: dict = sampling_params(self.mode) if self.mode else {}
        if self.max_tokens:
            params["max_tokens"] = self.max_tokens
        return self.client.reply(messages, params, on_end=ended)

    def command(self, line: str) -> CommandResult:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        name = name.lower()
        if name in EXIT_COMMANDS:
            return CommandResult("bye", quit=True)
        if name in ("/help", "/?"):
            return CommandResult(HELP)
        if name == "/clear":
            n = len(self.conversation.turns)
            self.conversation.clear()
            kept = " (the system prompt stays)" if self.conversation.system else ""
            return CommandResult(f"cleared {n} messages{kept}")
        if name == "/system":
            self.conversation.system = arg or None
            return CommandResult(f"system prompt set ({len(arg)} characters)" if arg else "system prompt removed")
        if name == "/mode":
            if arg not in argv.SAMPLING_PROFILES:
                raise KvmemError(f"/mode takes one of: {', '.join(argv.SAMPLING_PROFILES)}")
            self.mode = arg
            params = ", ".join(f"{k} {v:g}" for k, v in sampling_params(arg).items())
            return CommandResult(f"mode {arg}: {params}")
        if name in ("/save", "/load"):
            path = self._path_arg(name, arg)
            if name == "/save":
                self.conversation.save(path)
                return CommandResult(f"saved {len(self.conversation.messages())} messages to {path}")
            self.conversation = Conversation.load(path)
            return CommandResult(f"loaded {len(self.conversation.messages())} messages from {path}")
        if name == "/image":
            if not arg:
                n, self.images = len(self.images), []
                return CommandResult(f"dropped {n} waiting image{'s' if n != 1 else ''}")
            path = self._path_arg(name, arg)
            self.images.append(image_part(path))
            n = len(self.images)
            return CommandResult(f"{path.name} ({path.stat().st_size / 1024:.0f} KiB) goes with your next message"
                                 + (f" ({n} images)" if n > 1 else ""))
        if name == "/stats":
            stats = self.client.server_stats()
            return CommandResult("\n".join(describe(stats, self.last_turn, self.mode,
                                                    len(self.conversation.messages()))))
        raise KvmemError(f"unknown command {name}", hint="/help lists the commands")

    @staticmethod
    def _path_arg(name: str, arg: str) -> Path:
        try:
            parts = shlex.split(arg)
        except ValueError as exc:
            raise KvmemError(f"{name}: {exc}") from None
        if len(parts) != 1:
            example = "photo.png" if name == "/image" else "chat.json"
            raise KvmemError(f"{name} takes one file name", hint=f"{name} {example}")
        return Path(parts[0]).expanduser()


def is_command(text: str) -> bool:
    return text.startswith("/") and not text.startswith("//")


def read_message(read_line: Callable[[str], str], prompt: str = ">>> ", more: str = "... ") -> str | None:
    """One message from `read_line(prompt)` (input-like; EOFError at the end): a line, lines joined
    while they end with a backslash, or a block between two \"\"\" lines. None at end of input."""
    try:
        line = read_line(prompt)
    except EOFError:
        return None
    if line.strip().startswith(MULTILINE_FENCE):
        first = line.strip()[len(MULTILINE_FENCE):]
        if first.endswith(MULTILINE_FENCE):  # """one line"""
            return first[:-len(MULTILINE_FENCE)]
        lines = [first] if first else []
        while True:
            try:
                line = read_line(more)
            except EOFError:
                break  # an unclosed block ends with the input
            if line.rstrip().endswith(MULTILINE_FENCE):
                tail = line.rstrip()[:-len(MULTILINE_FENCE)]
                if tail:
                    lines.append(tail)
                break
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        try:
            line = read_line(more)
        except EOFError:
            line = ""
            break
    lines.append(line)
    return "\n".join(lines)
