"""``labrl judge serve-mock | validate FILE``: the CI mock judge and rubric task files."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> None:
    judge = subparsers.add_parser(
        "judge", help="rubric judges: run the mock judge, validate rubric task files"
    )
    sub = judge.add_subparsers(dest="judge_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("serve-mock", help="serve the deterministic OpenAI-compatible mock judge")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
    p.add_argument(
        "--fault",
        default="none",
        choices=("none", "garbage", "out_of_range", "missing_item", "http_500", "http_429", "timeout"),
        help="answer every request (or the first --fail-first) with this fault (default none)",
    )
    p.add_argument(
        "--fail-first", type=int, default=None, help="faulty requests before healthy ones (default: all)"
    )
    p.add_argument("--hang-s", type=float, default=30.0, help="sleep of the timeout fault")
    p.add_argument(
        "--api-key-env", default=None, help="require the key held in this env var as a Bearer token"
    )
    p.set_defaults(func=cmd_serve_mock)

    p = sub.add_parser("validate", help="validate a JSONL file of rubric tasks (errors name the line)")
    p.add_argument("path", help="the JSONL file of rubric tasks")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_validate)


def cmd_serve_mock(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from labrl.errors import ConfigError
    from labrl.verifiers.rubric.mock_judge import MockJudgeConfig, create_app

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ConfigError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    config = MockJudgeConfig(
        fault=args.fault, fail_first=args.fail_first, hang_s=args.hang_s, api_key=api_key
    )
    print(f"mock judge on http://{args.host}:{args.port}/v1 (fault={args.fault}); Ctrl-C to stop", flush=True)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from collections import Counter

    from labrl.envs.judged.tasks import load_tasks

    tasks = load_tasks(args.path)
    splits = Counter(t.resolved_split for t in tasks)
    topics = Counter(t.topic for t in tasks)
    kinds = Counter(item.kind for t in tasks for item in t.rubric.items)
    summary = {
        "tasks": len(tasks),
        "splits": dict(splits),
        "topics": dict(topics),
        "item_kinds": dict(kinds),
        "with_reference_answer": sum(t.reference_answer is not None for t in tasks),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{args.path}: {len(tasks)} valid tasks; splits {dict(splits)}; item kinds {dict(kinds)}")
    return 0
