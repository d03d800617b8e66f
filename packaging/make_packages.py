#!/usr/bin/env python3
"""Build and package engines for the six-SM matrix (or a subset), with one SHA256SUMS.

    python packaging/make_packages.py --sm 90 --out dist/     # build + package sm_90
    python packaging/make_packages.py --sm all --dry-run      # the exact cmake commands, all six
    python packaging/make_packages.py --cpu --out dist/       # the CPU engine too

The matrix itself (SMs, cards, minimum driver) lives in kvmem_llama/data/sm_matrix.json.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvmem_llama.build import parse_sms, plan_build, run_build
from kvmem_llama.engine import sm_matrix
from kvmem_llama.errors import KvmemError
from kvmem_llama.packaging import package_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sm", default="all", help="comma list of SMs or `all` (default)")
    parser.add_argument("--cpu", action="store_true", help="also build and package the CPU engine")
    parser.add_argument("--out", type=Path, default=Path("dist"), help="output directory")
    parser.add_argument("--dry-run", action="store_true", help="print the build commands only")
    parser.add_argument("-j", "--jobs", type=int, default=None)
    args = parser.parse_args(argv)
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
