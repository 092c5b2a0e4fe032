"""``labrl train CONFIG [key.sub=value ...]``: run RL training from a YAML run config."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a policy on an env (sync, one-step-off or pipeline RL)",
        description="Train from CONFIG (YAML). Overrides: dotted keys, e.g. pipeline.max_staleness=8 learner.optimizer.lr=3e-4. "
        "A run directory that holds a checkpoint is resumed.",
    )
    p.add_argument("config", help="YAML run config, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides (YAML values)")
    p.add_argument("--fresh", action="store_true", help="refuse to resume an existing run directory")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live view")
    p.set_defaults(func=cmd_train)


# 128 + signal number, what a shell reports for a process its signal ended
STOP_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


def stopped_line(summary: dict[str, Any], run_dir: str) -> str:
    """The one line printed when a signal stopped the run."""
    if summary.get("checkpoint"):
        saved = f"checkpoint {summary['checkpoint']} saved; run the same command to resume"
    else:
        saved = "nothing saved (stopped during the warm start); run the same command to start again"
    return f"labrl: stopped by {summary['stopped_by']} at step {summary['step']}: {saved} ({run_dir})"


def cmd_train(args: argparse.Namespace) -> int:
    from labrl.harness.config import load_run_config
    from labrl.harness.pipeline.runner import train

    cfg = load_run_config(args.config, list(args.overrides))
    summary = asyncio.run(train(cfg, fresh=args.fresh, progress=False if args.no_progress else None))
    if summary.get("stopped_by"):
        print(stopped_line(summary, cfg.run_dir))
        return STOP_EXIT_CODES.get(summary["stopped_by"], 130)
    last = summary["eval"]
    acc = f"{last['accuracy']:.3f} at step {last['step']}" if last else "n/a"
    state = "interrupted (checkpoint saved; run again to resume)" if summary["interrupted"] else "done"
    print(
        f"{state}: {summary['step']} steps in {summary['total_wall_s'] / 60:.1f} min; "
        f"held-out accuracy {acc}; run directory {cfg.run_dir}"
    )
    return 0
