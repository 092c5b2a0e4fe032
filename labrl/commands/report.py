"""``labrl report RUN_DIR``: plots and a short text summary of a training run."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="plot a run's metrics (PNG) and print a summary")
    p.add_argument("run_dir", help="the run directory written by labrl train")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/report)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from labrl.harness.report import write_report

    result = write_report(args.run_dir, args.out)
    print(result.summary)
    for path in result.plots:
        print(f"wrote {path}")
    return 0
