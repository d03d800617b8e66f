"""A small client for any OpenAI-compatible server: chat completions, plus the server's tokenizer.

Lengths are measured with the server's own tokenizer: llama.cpp's `POST /tokenize`
(`{"content": ...}`) and vLLM's (`{"model": ..., "prompt": ...}`) are both understood.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from kvmem_llama.errors import KvmemError


@dataclass
class Completion:
    text: str
    latency_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str | None
    cached_tokens: int | None = None  # prompt tokens the server reused from its cache (explains fast answers)


class EvalClient:
    """Talks to one endpoint. `base_url` is the server root (a trailing `/v1` is accepted)."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 1800.0,
                 api_key: str | None = None):
        root = base_url.rstrip("/")
        if root.endswith("/v1"):
            root = root[:-3]
        self.root = root
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers)
        self._model = model

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EvalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return self._http.request(method, f"{self.root}{path}", **kw)
        except httpx.ConnectError as exc:
            raise KvmemError(f"cannot connect to {self.root}: {exc}",
                             hint="is the server running? pass its root URL, e.g. http://127.0.0.1:8080") from None
        except httpx.TimeoutException:
            raise KvmemError(f"{self.root}{path} timed out",
                             hint="long prompts on a CPU take a while; raise --timeout or lower --lengths") from None

    @property
    def model(self) -> str:
        """The model id to send: the one given, else the first of `/v1/models`."""
        if self._model is None:
            resp = self._request("GET", "/v1/models")
            if resp.status_code != 200:
                raise KvmemError(f"GET /v1/models answered {resp.status_code}", hint="pass --model ID")
            data = resp.json().get("data") or []
            if not data:
                raise KvmemError("the server lists no models", hint="pass --model ID")
            self._model = str(data[0]["id"])
        return self._model

    def context_size(self) -> int | None:
        """The per-request context of the server when it says so (llama.cpp `/props`), else None."""
        try:
            resp = self._request("GET", "/props")
            if resp.status_code == 200:
                n_ctx = resp.json().get("default_generation_settings", {}).get("n_ctx")
                if n_ctx:
                    return int(n_ctx)
        except (KvmemError, ValueError):
            pass
        return None

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` by the server's tokenizer, without BOS/special tokens."""
        resp = self._request("POST", "/tokenize", json={"content": text, "add_special": False})
        if resp.status_code == 200 and "tokens" in resp.json():
            return len(resp.json()["tokens"])
        # vLLM's shape of the same endpoint
        resp2 = self._request("POST", "/tokenize", json={"model": self.model, "prompt": text,
                                                         "add_special_tokens": False})
        if resp2.status_code == 200:
            body = resp2.json()
            return int(body.get("count", len(body.get("tokens", []))))
        raise KvmemError(f"{self.root} has no usable /tokenize (answered {resp.status_code})",
                         hint="lengths are measured with the server's tokenizer: use llama-server or vLLM")

    def token_pieces(self, text: str) -> list[str]:
        """The text of each token of `text` (llama.cpp only); used to locate needles precisely."""
        resp = self._request("POST", "/tokenize", json={"content": text, "add_special": False,
                                                        "with_pieces": True})
        resp.raise_for_status()
        return [t["piece"] if isinstance(t["piece"], str) else "" for t in resp.json()["tokens"]]

    def apply_template(self, messages: list[dict]) -> str | None:
        """The prompt text the server renders for these chat messages (llama.cpp `/apply-template`).

        None when the server has no such endpoint (vLLM): answer positions are then unknown.
        """
        try:
            resp = self._request("POST", "/apply-template", json={"messages": messages})
        except KvmemError:
            return None
        if resp.status_code != 200:
            return None
        prompt = resp.json().get("prompt")
        return prompt if isinstance(prompt, str) else None

    def token_index(self, text: str, offsets: list[int]) -> list[int] | None:
        """Token positions of the characters at `offsets` of `text`, tokenized as the server does a prompt.

        llama-server tokenizes a chat prompt with special tokens added (BOS where the model wants
        one) and parsed; `/tokenize` with `add_special` and `with_pieces` gives the same tokens and
        their text, so a character offset maps to the token whose bytes contain it. Tokens the
        tokenizer adds in front (BOS) have pieces that are not in `text` and are skipped when the
        pieces are aligned. None when the server has no such endpoint or the pieces do not align.
        """
        try:
            resp = self._request("POST", "/tokenize", json={"content": text, "add_special": True,
                                                            "with_pieces": True})
        except KvmemError:
            return None
        if resp.status_code != 200:
            return None
        tokens = resp.json().get("tokens") or []
        if not tokens or not isinstance(tokens[0], dict):
            return None
        pieces = [t["piece"].encode("utf-8") if isinstance(t["piece"], str) else bytes(t["piece"]) for t in tokens]
        data = text.encode("utf-8")
        aligned = _aligned_start(pieces, data)
        if aligned is None:
            return None
        lead, shift = aligned
        starts: list[int] = []  # byte offset in `data` where each token from `lead` on begins
        pos = -shift
        for piece in pieces[lead:]:
            starts.append(pos)
            pos += len(piece)
        out: list[int] = []
        for offset in offsets:
            at = len(text[:offset].encode("utf-8"))
            # the last token starting at or before the byte: the one that holds it
            lo, hi = 0, len(starts) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if starts[mid] <= at:
                    lo = mid
                else:
                    hi = mid - 1
            out.append(lead + lo)
        return out

    def chat(self, prompt: str, max_tokens: int, seed: int = 0) -> Completion:
        """One greedy chat completion of a single user message."""
        return self.chat_messages([{"role": "user", "content": prompt}], max_tokens, seed)

    def chat_messages(self, messages: list[dict], max_tokens: int, seed: int = 0,
                      cache_prompt: bool | None = None) -> Completion:
        """One greedy chat completion of a conversation. `cache_prompt` True asks llama-server to
        reuse the cached prefix (its default; said explicitly where a follow-up turn depends on it)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "seed": seed}
        if cache_prompt is not None:
            body["cache_prompt"] = cache_prompt
        start = time.perf_counter()
        resp = self._request("POST", "/v1/chat/completions", json=body)
        latency = time.perf_counter() - start
        if resp.status_code != 200:
            detail = resp.text[:500]
            hint = None
            low = detail.lower()
            if "--kvmem" in low:
                hint = ("a KV tiering limit of the server: with --run, pass the flag it names through --server-arg, "
                        "e.g. --server-arg='--kvmem-host-mib 1024'")
            elif resp.status_code == 400 and ("exceed" in low or "context size" in low or "context length" in low):
                hint = "the prompt does not fit the server's context: start it with a larger -c or lower --lengths"
            raise KvmemError(f"chat completion failed with HTTP {resp.status_code}: {detail}", hint=hint)
        data = resp.json()
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or ""
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Completion(text, latency, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                          choice.get("finish_reason"), cached)


def _aligned_start(pieces: list[bytes], data: bytes, max_lead: int = 4) -> tuple[int, int] | None:
    """(leading tokens that are not part of `data` (BOS and the like), bytes the tokenizer put in
    front of the text (SentencePiece's space)); None when the pieces do not spell `data`."""
    total = sum(len(p) for p in pieces)
    skipped = 0
    for lead in range(min(max_lead, len(pieces)) + 1):
        rest = total - skipped
        if rest in (len(data), len(data) + 1):
            joined = b"".join(pieces[lead:])
            if joined == data:
                return lead, 0
            if joined == b" " + data:
                return lead, 1
        if lead < len(pieces):
            skipped += len(pieces[lead])
    return None
