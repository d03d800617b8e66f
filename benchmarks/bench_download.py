"""Download throughput on loopback: 1 vs N connections, against tests/hub_server.py in its own process.

    python benchmarks/bench_download.py [--size-mib 256] [--connections 1 8] [--rate-mib 0 32] [--out FILE]

For each per-connection rate cap (0 = uncapped; a cap emulates a CDN's per-connection
limit, where segmenting pays) and each connection count, downloads one synthetic GGUF into a
fresh store with the real downloader and reports the transfer speed (network phase) and the
total including the sha256 + GGUF verification. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hub_server import make_gguf  # noqa: E402

from kvmem_llama.models.download import Download, Progress, download_verified  # noqa: E402
from kvmem_llama.models.hub import Hub  # noqa: E402


class Timer(Progress):
    def __init__(self) -> None:
        self.t_start = self.t_verify = 0.0

    def start(self, total: int, done: int, label: str) -> None:
        self.t_start = time.perf_counter()

    def phase(self, text: str, total: int) -> None:
        if text.startswith("verifying"):
            self.t_verify = time.perf_counter()


def start_server(path: Path, rate: float | None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(ROOT / "tests" / "hub_server.py"), str(path), "--repo", "bench/model-GGUF"]
    if rate:
        cmd += ["--rate", str(rate)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise SystemExit(f"hub server did not start: {url!r}")
    return proc, url


def run_once(url: str, path: Path, connections: int, work: Path) -> dict:
    os.environ["HF_ENDPOINT"] = url
    hub = Hub()
    info = hub.file_info("bench/model-GGUF", path.name)
    timer = Timer()
    t0 = time.perf_counter()
    target = work / f"c{connections}" / path.name
    download_verified(hub.client, Download(info.url, info.size, info.sha256, path.name), target, work / ".partial",
                      connections=connections, progress=timer)
    t_end = time.perf_counter()
    hub.client.close()
    target.unlink()
    net = timer.t_verify - timer.t_start
    return {"connections": connections, "bytes": info.size, "transfer_s": round(net, 3),
            "transfer_mib_s": round(info.size / net / 2**20, 1), "total_s": round(t_end - t0, 3),
            "verify_s": round(t_end - timer.t_verify, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rate-mib", type=float, nargs="+", default=[0, 32],
                    help="per-connection server rate caps in MiB/s (0 = uncapped)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per point; the best is reported")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_download.json")
    args = ap.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-") as tmp:
        work = Path(tmp)
        src = make_gguf(work / "bench-model.gguf", args.size_mib << 20, seed=42)
        for rate_mib in args.rate_mib:
            proc, url = start_server(src, rate_mib * 2**20 if rate_mib else None)
            try:
                for conns in args.connections:
                    runs = [run_once(url, src, conns, work) for _ in range(args.repeat)]
                    best = min(runs, key=lambda r: r["transfer_s"])
                    results.append({"rate_cap_mib_s": rate_mib or None, **best,
                                    "runs_transfer_s": [r["transfer_s"] for r in runs]})
            finally:
                proc.terminate()
                proc.wait()

    print(f"{'cap/conn MiB/s':>15} {'conns':>6} {'size MiB':>9} {'transfer s':>11} {'MiB/s':>8} "
          f"{'verify s':>9} {'total s':>8}")
    for r in results:
        cap = f"{r['rate_cap_mib_s']:.0f}" if r["rate_cap_mib_s"] else "none"
        print(f"{cap:>15} {r['connections']:>6} {r['bytes'] / 2**20:>9.0f} {r['transfer_s']:>11.2f} "
              f"{r['transfer_mib_s']:>8.1f} {r['verify_s']:>9.2f} {r['total_s']:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg": os.getloadavg(), "size_mib": args.size_mib, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())}
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
