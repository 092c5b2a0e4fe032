"""``labrl report RUN_DIR``: plots and a short text summary of a training run."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="plot a run's metrics (PNG) and print a summary")
    p.add_argument("run_dir", help="the run directory written by labrl train")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/report)")
    p.add_argument(
        "--x",
        choices=("step", "time"),
        default="step",
        help="x axis of the plots: learner step (default) or wall-clock minutes of training",
    )
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from labrl.harness.report import write_report

    result = write_report(args.run_dir, args.out, x=args.x)
    print(result.summary)
    for path in result.plots:
        print(f"wrote {path}")
    return 0
