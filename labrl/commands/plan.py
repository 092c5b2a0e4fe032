"""``labrl plan CONFIG [--from-run RUN_DIR] [--budget gpus=N,cpus=M] [--plot PATH]``: predicted steps/s and
staleness of layouts of a run config (docs/planning.md)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="simulate layouts of a run config, calibrated from a run's episodes.jsonl or from recorded "
        "benchmark figures, and rank them",
        description="Calibrate from RUN_DIR (episodes.jsonl, metrics.jsonl) or, without --from-run, from the "
        "config, the env's budgets and benchmarks/results; simulate CONFIG with other pipeline.max_staleness and "
        "pipeline.max_concurrent_episodes values (or, with --budget, the Ray layouts that fit it) and print the "
        "best: within the config's staleness bound first, then the fastest, then the cheapest (docs/planning.md).",
    )
    p.add_argument("config", help="YAML run config, e.g. configs/quickstart.yaml")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as labrl train takes them"
    )
    p.add_argument("--from-run", metavar="RUN_DIR", help="a run directory to calibrate from")
    p.add_argument(
        "--budget",
        metavar="gpus=N,cpus=M",
        help="search the backend=ray layouts that fit N GPUs and M CPUs",
    )
    p.add_argument("--plot", metavar="PATH", help="write the best layout's staleness and utilisation PNG")
    p.add_argument(
        "--env-step-s", type=float, help="median seconds of an env step (no --from-run; default: assumed 1 s)"
    )
    p.add_argument(
        "--env-sigma",
        type=float,
        help="lognormal sigma of an env step (no --from-run; default: assumed 1.288)",
    )
    p.add_argument(
        "--figures",
        metavar="DIR",
        help="recorded benchmark results to read the machine figures from (default: benchmarks/results)",
    )
    p.add_argument(
        "--steps", type=int, default=100, help="learner steps to simulate per layout (default 100)"
    )
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5; the config's own always)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated draws (default 0)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from labrl.errors import ConfigError
    from labrl.harness.backends.parts import make_env_factory
    from labrl.harness.config import load_run_config
    from labrl.harness.planning.budget import env_pool_of, parse_budget, search
    from labrl.harness.planning.calibrate import calibrate_run
    from labrl.harness.planning.figures import load_figures
    from labrl.harness.planning.plan import (
        calibrate_sampler,
        env_slot_cap,
        format_plan,
        layout_of,
        machines_line,
        plan,
        ray_model,
        run_header,
    )
    from labrl.harness.planning.priors import (
        config_hardware,
        describe,
        figure_line,
        prior_episode,
        prior_layout,
        search_figure_keys,
    )

    if args.steps < 2 or args.top < 1:
        raise ConfigError(f"--steps must be >= 2 and --top >= 1 (got {args.steps}, {args.top})")
    if args.from_run and (args.env_step_s is not None or args.env_sigma is not None):
        raise ConfigError("--env-step-s and --env-sigma set the env without a run; --from-run measures it")
    budget = parse_budget(args.budget) if args.budget else None
    cfg = load_run_config(args.config, list(args.overrides))
    bound = cfg.pipeline.effective_max_staleness
    env_budgets = make_env_factory(cfg)().spec.budgets
    figures = load_figures(args.figures)
    pool = env_pool_of(env_budgets)
    if args.from_run:
        episodes, machines = calibrate_run(args.from_run)
        episode = episodes.episode
        sampler = calibrate_sampler(cfg, machines, episodes)
        driver_s = figures["driver_s_per_episode"].value
        base = ray_model(
            cfg,
            layout_of(
                cfg, machines, sampler, staleness=bound, concurrency=cfg.pipeline.max_concurrent_episodes
            ),
            pool=pool,
            driver_s_per_episode=driver_s,
        )
        header = run_header(episodes, machines, sampler, bound)
        # in process the traced env calls include any wait for the env's pool; under Ray the env workers
        # of the layout cap them, as the layouts without a run and --budget's are
        cap = env_slot_cap(cfg.ray.env_workers, pool) if cfg.backend == "ray" else None
        if cfg.backend == "ray":
            header.append(
                f"ray: driver {driver_s * 1e3:.1f} ms/episode ({figures['driver_s_per_episode'].source}), "
                f"env slots at most {'any' if cap is None else cap} (ray.env_workers x the env's pool)"
            )
    else:
        hw = config_hardware(cfg)
        episode = prior_episode(
            cfg, env_budgets, figures, env_step_s=args.env_step_s, env_sigma=args.env_sigma
        )
        base = prior_layout(cfg, figures, hw)
        given = args.env_step_s is not None or args.env_sigma is not None
        header = describe(cfg, env_budgets, episode, figures, hw, env_given=given)
        header.append(machines_line(base, bound))
        cap = env_slot_cap(cfg.ray.env_workers if cfg.backend == "ray" else 1, pool)
    if budget is not None:
        params = cfg.model.resolve().active_matmul_parameter_count
        header.append(
            f"budget: {budget.gpus} GPUs, {budget.cpus} CPUs; backend=ray layouts on these figures (docs/planning.md):"
        )
        header += [figure_line(figures[k], params) for k in search_figure_keys(cfg)]
        rows = search(cfg, budget, episode, env_budgets, figures, steps=args.steps, seed=args.seed)
    else:
        rows = plan(cfg, episode, base, env_slot_cap=cap, steps=args.steps, seed=args.seed)
    print(format_plan(rows, header, bound=bound, top=args.top))
    if args.plot:
        from labrl.harness.planning.plot import plot_layout

        print(f"wrote {plot_layout(rows[0], args.plot, bound=bound)} (the first layout above)")
    return 0
