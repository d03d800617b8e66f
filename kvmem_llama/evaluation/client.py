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

    def chat(self, prompt: str, max_tokens: int, seed: int = 0) -> Completion:
        """One greedy chat completion of a single user message."""
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "seed": seed}
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
