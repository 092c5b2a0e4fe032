"""``labrl plan CONFIG --from-run RUN_DIR [key=value ...]``: predicted steps/s and staleness of a few layouts."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="simulate layouts of a run config, calibrated from a run's episodes.jsonl, and rank them",
        description="Calibrate from RUN_DIR (episodes.jsonl, metrics.jsonl), simulate CONFIG with other "
        "pipeline.max_staleness and pipeline.max_concurrent_episodes values, print the fastest (docs/planning.md).",
    )
    p.add_argument("config", help="YAML run config, e.g. configs/quickstart.yaml")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as labrl train takes them"
    )
    p.add_argument("--from-run", required=True, metavar="RUN_DIR", help="a run directory to calibrate from")
    p.add_argument(
        "--steps", type=int, default=100, help="learner steps to simulate per layout (default 100)"
    )
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5; the config's own always)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated draws (default 0)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from labrl.errors import ConfigError
    from labrl.harness.config import load_run_config
    from labrl.harness.planning.calibrate import calibrate_run
    from labrl.harness.planning.plan import format_plan, plan

    if args.steps < 2 or args.top < 1:
        raise ConfigError(f"--steps must be >= 2 and --top >= 1 (got {args.steps}, {args.top})")
    cfg = load_run_config(args.config, list(args.overrides))
    episodes, machines = calibrate_run(args.from_run)
    rows = plan(cfg, episodes, machines, steps=args.steps, seed=args.seed)
    print(format_plan(rows, episodes, machines, bound=cfg.pipeline.effective_max_staleness, top=args.top))
    return 0
