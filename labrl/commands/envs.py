"""``labrl envs list | show ID [--json] | sample ID | check [ID ...] | serve ID --protocol P``."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

from labrl.errors import ConfigError, LabrlError


def add_parser(subparsers: Any) -> None:
    envs = subparsers.add_parser("envs", help="list, show, sample and check environments")
    sub = envs.add_subparsers(dest="envs_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("list", help="registered env ids with their descriptions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="the full spec of one env and the options it accepts (JSON)")
    p.add_argument("env_id", help="a registered env id (labrl envs list)")
    p.add_argument(
        "--json", action="store_true", help="the manifest a hub or a protocol's metadata route publishes"
    )
    p.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE", help="env option (JSON value)"
    )
    p.set_defaults(func=cmd_show)

    from labrl.interop.servers import SERVERS, ServeSettings

    p = sub.add_parser("serve", help="serve one env over an environment protocol (docs/interop.md)")
    p.add_argument("env_id", help="a registered env id (labrl envs list)")
    p.add_argument("--protocol", choices=sorted(SERVERS), required=True, help="the wire protocol")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE", help="env option (JSON value)"
    )
    p.add_argument(
        "--max-sessions", type=int, default=ServeSettings.max_sessions, help="sessions held at once"
    )
    p.add_argument(
        "--tasks-per-split",
        type=int,
        default=ServeSettings.tasks_per_split,
        help="tasks each split lists on the task routes (any seed can be reset)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sample", help="play episodes with a scripted (gold) or random policy")
    p.add_argument("env_id", help="a registered env id (labrl envs list)")
    p.add_argument("-n", "--episodes", type=int, default=3, help="episodes to play (default 3)")
    p.add_argument(
        "--policy", choices=("gold", "random"), default="gold", help="the env's gold answer or a random one"
    )
    p.add_argument("--split", choices=("train", "test"), default="train", help="task split (default train)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first task; episode i uses seed+i")
    p.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE", help="env option (JSON value)"
    )
    p.add_argument("--json", action="store_true", help="print episodes as JSON lines")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("dry-run", help="play every registered env with its gold (else random) policy")
    p.add_argument("-n", "--episodes", type=int, default=2, help="episodes per env")
    p.add_argument("--split", choices=("train", "test"), default="test", help="task split (default test)")
    p.set_defaults(func=cmd_dry_run)

    p = sub.add_parser("check", help="run the contract checker (non-zero exit on failure)")
    p.add_argument("env_ids", nargs="*", help="env ids (default: every registered env)")
    p.add_argument("--seeds", type=int, default=8, help="task seeds the checks use (default 8)")
    p.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE", help="env option (JSON value)"
    )
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.set_defaults(func=cmd_check)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"option {pair!r} must look like KEY=VALUE")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw  # bare strings need no quotes
    return options


def cmd_list(args: argparse.Namespace) -> int:
    from labrl.envs.registry import registered_ids, registration

    rows = []
    for env_id in registered_ids():
        reg = registration(env_id)
        entry = reg.entry_point if isinstance(reg.entry_point, str) else repr(reg.entry_point)
        rows.append({"id": env_id, "entry_point": entry, "source": reg.source})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max((len(r["id"]) for r in rows), default=10)
        for row in rows:
            print(f"{row['id']:<{width}}  {row['entry_point']}  [{row['source']}]")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from labrl.envs.registry import env_options, spec

    if args.json:
        from labrl.interop.manifest import manifest

        print(json.dumps(manifest(args.env_id, parse_options(args.option)), indent=2, default=str))
        return 0
    shown = json.loads(spec(args.env_id).model_dump_json())
    shown["options"] = env_options(args.env_id)  # what `-o KEY=VALUE` / env.options accept
    print(json.dumps(shown, indent=2, default=str))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from labrl.interop.servers import ServeSettings, app_factory

    settings = ServeSettings(
        env_id=args.env_id,
        options=parse_options(args.option),
        max_sessions=args.max_sessions,
        tasks_per_split=args.tasks_per_split,
    )
    app = app_factory(args.protocol)(settings)
    print(f"serving {args.env_id} over {args.protocol} at http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from labrl.envs.episode import Episode, run_episode, scripted_policy
    from labrl.envs.registry import make

    options = parse_options(args.option)

    async def one(index: int) -> Episode:
        env = make(args.env_id, **options)
        try:
            task = env.make_task(args.split, args.seed + index)
            gold = env.gold_actions(task) if args.policy == "gold" else None
            if args.policy == "gold" and gold is None:
                raise ConfigError(f"{args.env_id} has no gold answer: use --policy random")
            rng = random.Random(args.seed + index)

            async def random_policy(messages: Any, tools: Any) -> Any:
                return env.random_action(task, rng)

            policy = scripted_policy(list(gold)) if gold is not None else random_policy
            return await run_episode(env, task, policy)
        finally:
            await env.close()

    async def all_episodes() -> list[Episode]:
        return await asyncio.gather(*(one(i) for i in range(args.episodes)))

    episodes = asyncio.run(all_episodes())
    for episode in episodes:
        if args.json:
            print(episode.model_dump_json())
            continue
        print(f"=== {episode.task.task_id} ({episode.task.split}, seed {episode.task.seed})")
        for message in episode.messages:
            print(f"[{message.role}] {message.content}")
        print(f"--> outcome={episode.outcome.value} reward={episode.reward} turns={episode.num_turns}\n")
    rewards = [e.reward for e in episodes if e.reward is not None]
    if rewards and not args.json:
        print(f"mean reward over {len(rewards)} scored episodes: {sum(rewards) / len(rewards):.3f}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from labrl.envs.checker import check_env
    from labrl.envs.registry import registered_ids

    options = parse_options(args.option)
    env_ids = args.env_ids or registered_ids()
    reports = [check_env(env_id, seeds=args.seeds, **options) for env_id in env_ids]
    if args.json:
        print(json.dumps([r.model_dump() for r in reports], indent=2))
    else:
        for report in reports:
            print(f"{'PASS' if report.passed else 'FAIL'} {report.env_id}")
            for check in report.checks:
                mark = "ok  " if check.passed else "FAIL"
                print(
                    f"  {mark} {check.name:<15} {check.seconds:6.2f}s  {check.detail.splitlines()[0] if check.detail else ''}"
                )
                if not check.passed and "\n" in check.detail:
                    print("       " + check.detail.replace("\n", "\n       "), file=sys.stderr)
    return 0 if all(r.passed for r in reports) else 1


def cmd_dry_run(args: argparse.Namespace) -> int:
    """Sample every registered env with a scripted policy; print transcripts and rewards."""
    from labrl.envs.registry import registered_ids

    summary: list[tuple[str, str]] = []
    for env_id in registered_ids():
        print(f"\n##### {env_id}")
        sample_args = argparse.Namespace(
            env_id=env_id,
            episodes=args.episodes,
            policy="gold",
            split=args.split,
            seed=0,
            option=[],
            json=False,
        )
        try:
            try:
                cmd_sample(sample_args)
                summary.append((env_id, "gold"))
            except ConfigError:  # no gold answer: show a random policy instead
                cmd_sample(argparse.Namespace(**{**vars(sample_args), "policy": "random"}))
                summary.append((env_id, "random"))
        except LabrlError as exc:
            print(f"labrl: {env_id} failed: {exc}", file=sys.stderr)
            summary.append((env_id, "FAILED"))
    print(f"\ndry run: {len(summary)} envs sampled ({', '.join(f'{e} [{p}]' for e, p in summary)})")
    return 1 if any(p == "FAILED" for _, p in summary) else 0
