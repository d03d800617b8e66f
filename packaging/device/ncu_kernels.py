"""Sum an `ncu --csv --metrics gpu__time_duration.sum` log by kernel: launches, total ms and share, largest first.

    python3 ncu_kernels.py NCU.csv
"""

import csv
import sys
from collections import defaultdict


def main(path: str) -> int:
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # the CSV rows; the program's own output is not quoted
    total_ns: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0].split("<")[0]
        total_ns[name] += float(row["Metric Value"].replace(",", ""))
        launches[name] += 1
    if not total_ns:
        print(f"no kernel times in {path}", file=sys.stderr)
        return 1
    whole = sum(total_ns.values())
    print("| kernel | launches | ms | share |\n|---|---:|---:|---:|")
    for name, ns in sorted(total_ns.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {launches[name]} | {ns / 1e6:.2f} | {100 * ns / whole:.1f}% |")
    print(f"| all | {sum(launches.values())} | {whole / 1e6:.2f} | 100% |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
