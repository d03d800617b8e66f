"""Running llama-server.

- `argv`: the flags kvmem sets, merging plan < sampling profile < user flags, engine capabilities;
- `process`: the one place that starts and stops a llama-server process (log, readiness, self-test);
- `registry`: the named servers of `kvmem ps/stop/logs` (one JSON record + one log each);
- `launch`: `kvmem run` as a library: prepare (model, engine, plan, argv), launch, start_server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerFailed", "ServerHandle", "start_server"]


def __getattr__(name: str) -> Any:
    # launch pulls in the planner and the model store; `serving.process` users (bench, tests) need neither
    if name in ("ServerHandle", "start_server"):
        from kvmem_llama.serving import launch

        return getattr(launch, name)
    if name == "ServerFailed":
        from kvmem_llama.serving.process import ServerFailed

        return ServerFailed
    raise AttributeError(name)
