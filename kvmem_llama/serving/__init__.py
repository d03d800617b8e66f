"""Running llama-server.

- `argv`: the flags kvmem sets, merging plan < sampling profile < user flags, engine capabilities;
- `process`: the one place that starts and stops a llama-server process (log, readiness, self-test);
- `registry`: the named servers of `kvmem ps/stop/logs` (one JSON record + one log each);
- `launch`: `kvmem run` as a library: prepare (model, engine, plan, argv), launch, start_server.
"""
