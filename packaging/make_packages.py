#!/usr/bin/env python3
"""Build and package engines for the six-SM matrix (or a subset), with one SHA256SUMS.

    python packaging/make_packages.py --sm 90 --out dist/     # build + package sm_90
    python packaging/make_packages.py --sm all --dry-run      # the exact cmake commands, all six
    python packaging/make_packages.py --cpu --out dist/       # the CPU engine too
    python packaging/make_packages.py --describe dist/ > packages.json   # name, bytes, sha256, build-info of each
    python packaging/make_packages.py --table packages.json [...]        # docs/gpu's table, from those files

The matrix itself (SMs, cards, minimum driver) lives in kvmem_llama/data/sm_matrix.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tarfile
from pathlib import Path

from kvmem_llama.build import parse_sms, plan_build, run_build
from kvmem_llama.engine import sm_matrix
from kvmem_llama.errors import KvmemError
from kvmem_llama.files import sha256_file
from kvmem_llama.packaging import package_engine

MiB = 1 << 20
TABLE_HEAD = ("| target | cards | driver floor | package MiB | build s | machine code (cuobjdump) | FA K/V pairs "
              "| sha256 |\n|---|---|---|---:|---:|---|---|---|")


def describe(folder: Path) -> list[dict]:
    """Each engine package in folder: its name, size, sha256 and the build-info.json inside it."""
    out = []
    for tarball in sorted(folder.glob("kvmem-engine-*.tar.gz")):
        with tarfile.open(tarball, "r:gz") as archive:
            handle = archive.extractfile(f"{tarball.name.removesuffix('.tar.gz')}/build-info.json")
            assert handle is not None
            info = json.load(handle)
        out.append({"package": tarball.name, "bytes": tarball.stat().st_size, "sha256": sha256_file(tarball),
                    "info": info})
    return out


def table_row(package: dict, cards: dict[str, dict]) -> str:
    """One markdown row of docs/gpu's table."""
    info = package["info"]
    target = cards.get(info["sms"][0], {}) if info["sms"] else {"cards": "CPU", "min_driver": "-"}
    code = info.get("machine_code") or {}
    elf = (", ".join(code.get("elf", [])) or code.get("error", "not recorded")) + (" + PTX" if code.get("ptx") else "")
    return (f"| {info['target']} | {target.get('cards', '?')} | {target.get('min_driver', '?')} | "
            f"{package['bytes'] / MiB:.1f} | {info.get('build_seconds', '-')} | {elf} | "
            f"{', '.join(info.get('fa_quants') or ['-'])} | `{package['sha256']}` |")


def table(packages: list[dict]) -> str:
    """docs/gpu's table, in the matrix's order of targets."""
    cards = {t["sm"]: t for t in sm_matrix()}
    order = list(cards)
    packages = sorted(packages, key=lambda p: order.index(p["info"]["sms"][0]) if p["info"]["sms"] else len(order))
    return "\n".join([TABLE_HEAD, *(table_row(p, cards) for p in packages)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sm", default="all", help="comma list of SMs or `all` (default)")
    parser.add_argument("--cpu", action="store_true", help="also build and package the CPU engine")
    parser.add_argument("--out", type=Path, default=Path("dist"), help="output directory")
    parser.add_argument("--dry-run", action="store_true", help="print the build commands only")
    parser.add_argument("-j", "--jobs", type=int, default=None)
    parser.add_argument("--describe", type=Path, metavar="DIR", help="print the packages in DIR as JSON")
    parser.add_argument("--table", nargs="+", type=Path, metavar="JSON", help="print the table of --describe's files")
    args = parser.parse_args(argv)
    if args.describe:
        print(json.dumps(describe(args.describe), indent=1))
        return 0
    if args.table:
        print(table([p for path in args.table for p in json.loads(path.read_text())]))
        return 0
    try:
        targets: list[str | None] = [*parse_sms(args.sm)] + ([None] if args.cpu else [])
        cards = {t["sm"]: t for t in sm_matrix()}
        for sm in targets:
            plan = plan_build(sm, args.jobs, dry_run=args.dry_run)
            label = f"sm_{sm} ({cards[sm]['cards']}; driver >= {cards[sm]['min_driver']})" if sm else "cpu"
            print(f"# {plan.key}: {label}", flush=True)
            if args.dry_run:
                print(shlex.join(plan.configure_args()))
                print(shlex.join(plan.build_args()))
                continue
            engine, _cached = run_build(plan, log=lambda m: print(f"  {m}", flush=True))
            tarball = package_engine(engine, args.out)
            print(f"  packaged {tarball}", flush=True)
    except KvmemError as exc:
        print(f"error: {exc}" + (f"\nhint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
