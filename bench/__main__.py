"""``python -m bench [suite ...] [--quick] [--out DIR]``: run benchmark suites, print tables, write CSVs."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import kernel, memory, muon, offload, overhead, step
from bench.harness import RESULTS_DIR, NotEnoughGPUs, format_table, measured_on, write_csv

# name -> module with SUMMARY (one line for --help), TABLES (what to print) and run(quick) -> rows.
SUITES = {"step": step, "memory": memory, "kernel": kernel, "offload": offload, "muon": muon, "overhead": overhead}


def suite_name(value: str) -> str:
    """``value`` if it names a suite: an argparse ``type``, as ``choices`` would be checked against the empty default.

    Raises:
        argparse.ArgumentTypeError: on any other name, listing the suites.
    """
    if value not in SUITES:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(map(repr, SUITES))})")
    return value


def main(argv: list[str] | None = None) -> None:
    width = max(map(len, SUITES))
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run zeroshard's benchmark suites: each prints its tables, each with a one-line legend,\nand writes a CSV.",
        epilog="suites:\n" + "\n".join(f"  {name.ljust(width)}  {suite.SUMMARY}" for name, suite in SUITES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suites", nargs="*", type=suite_name, metavar="{" + ",".join(SUITES) + "}",
                        help="suites to run, in the order given (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes: each suite in under 2 minutes on 2 CPU cores")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, metavar="DIR", help=f"where the CSV files go (default: {RESULTS_DIR})")
    args = parser.parse_args(argv)
    skipped = []
    for name in args.suites or list(SUITES):
        start = time.perf_counter()
        try:
            rows = SUITES[name].run(quick=args.quick)
        except NotEnoughGPUs as e:  # a one-GPU machine still runs the single-rank suites
            print(f"\n{name}: skipped: {e}\n", flush=True)
            skipped.append(name)
            continue
        for table in SUITES[name].TABLES:
            print(f"\n{format_table(table.select(rows))}\n{table.legend}")
        print(measured_on())
        path = write_csv(name, rows, args.out)
        print(f"\n{name}: {time.perf_counter() - start:.0f} s, wrote {path}\n")
    if skipped:  # what was asked for and did not run fails the command, after the rest ran
        sys.exit(f"skipped for want of GPUs: {', '.join(skipped)}")


if __name__ == "__main__":
    main()
