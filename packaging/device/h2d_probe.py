"""Pinned host->device copy bandwidth on the device machine: the ceiling for the stager's stage-ins.

Copies 1 GiB from pinned host memory in chunks of the sizes a stage-in uses (one host slot) and larger,
on one CUDA stream, timed by CUDA events; prints one line per chunk size (min / median GB/s of 5 repeats).
Runs with the device image's PyTorch:  python3 packaging/device/h2d_probe.py
"""

import statistics

import torch

TOTAL = 1 << 30
CHUNKS_MIB = (0.5, 4, 8, 64, 1024)


def gbps(chunk: int, host: torch.Tensor, dev: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for off in range(0, TOTAL, chunk):
        dev[off : off + chunk].copy_(host[off : off + chunk], non_blocking=True)
    end.record()
    end.synchronize()
    return TOTAL / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    host = torch.empty(TOTAL, dtype=torch.uint8).pin_memory()
    dev = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
    gbps(TOTAL, host, dev)  # warm-up
    for mib in CHUNKS_MIB:
        chunk = int(mib * (1 << 20))
        runs = [gbps(chunk, host, dev) for _ in range(5)]
        print(f"h2d pinned chunk {mib:g} MiB: min {min(runs):.1f} median {statistics.median(runs):.1f} GB/s")


if __name__ == "__main__":
    main()
