"""``python -m bench [suite ...] [--quick] [--out DIR]``: run benchmark suites, print tables, write CSVs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import kernel, memory, offload, step
from bench.harness import RESULTS_DIR, format_table, write_csv

# name -> run(quick) -> rows.
SUITES = {"step": step.run, "memory": memory.run, "kernel": kernel.run, "offload": offload.run}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("suites", nargs="*", choices=[[]] + list(SUITES), help="suites to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes: each suite in under 2 minutes on 2 CPU cores")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"where the CSV files go (default: {RESULTS_DIR})")
    args = parser.parse_args(argv)
    for name in args.suites or list(SUITES):
        start = time.perf_counter()
        rows = SUITES[name](quick=args.quick)
        print(format_table(rows))
        path = write_csv(name, rows, args.out)
        print(f"{name}: {time.perf_counter() - start:.0f} s, wrote {path}\n")


if __name__ == "__main__":
    main()
