"""Running llama-server.

- `argv`: the one argv scanner (scan_flags), the flags kvmem sets, merging plan < sampling profile < user
  flags, engine capabilities, what an argv asks for (API key, download flags, per-request context);
- `process`: the one place that starts and stops a llama-server process (log, waiting until ready, exit);
- `readiness`: the checks that need no process: the tiering self-test's prompt and verdict, the exposure warning;
- `registry`: the named servers of `kvmem ps/stop/logs` (one JSON record + one log each);
- `launch`: `kvmem run` as a library: prepare (model, engine, plan, argv), launch, start_server.
"""
