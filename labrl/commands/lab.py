"""``labrl lab ...``: run the mock autonomous lab.

::

    export LABRL_MOCK_LAB_TOKEN=secret
    labrl lab serve-mock --state-dir runs/mock-lab --port 8765 --latency-median 2 \\
        --error-rate 0.1 --hang-rate 0.05 --duplicate-rate 0.02
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from labrl.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser("lab", help="run the mock autonomous lab")
    sub = lab.add_subparsers(dest="lab_command", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser("serve-mock", help="serve the mock lab's REST API on loopback")
    serve.add_argument(
        "--config", type=Path, help="a JSON file with MockLabConfig fields (flags override it)"
    )
    serve.add_argument("--host", default=None, help="loopback address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--state-dir", type=Path, default=None, help="where jobs are kept across restarts")
    serve.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    serve.add_argument("--latency-median", type=float, default=None, dest="latency_median_s")
    serve.add_argument("--latency-sigma", type=float, default=None)
    serve.add_argument("--instruments", type=int, default=None)
    serve.add_argument("--seed", type=int, default=None)
    for name in (
        "error_rate",
        "error_after_commit",
        "hang_rate",
        "hang_s",
        "drop_rate",
        "duplicate_rate",
        "result_ttl_s",
    ):
        serve.add_argument("--" + name.replace("_", "-"), type=float, default=None, dest="fault_" + name)
    serve.set_defaults(func=_serve_mock)


def build_config(args: argparse.Namespace):  # -> MockLabConfig (import deferred: keeps `labrl --help` light)
    from pydantic import ValidationError

    from labrl.lab_adapters.mock.server import MockLabConfig

    data: dict = json.loads(args.config.read_text()) if args.config else {}
    for field in (
        "host",
        "port",
        "state_dir",
        "token_env",
        "latency_median_s",
        "latency_sigma",
        "instruments",
        "seed",
    ):
        value = getattr(args, field)
        if value is not None:
            data[field] = value
    faults = dict(data.get("faults", {}))
    for key, value in vars(args).items():
        if key.startswith("fault_") and value is not None:
            faults[key.removeprefix("fault_")] = value
    data["faults"] = faults
    data.setdefault("state_dir", "runs/mock-lab")
    try:
        return MockLabConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid mock lab config: {exc}") from None


def _serve_mock(args: argparse.Namespace) -> int:
    from labrl.lab_adapters.mock.server import serve

    config = build_config(args)
    print(
        f"mock lab on http://{config.host}:{config.port} (state in {config.state_dir}; "
        f"faults: {config.faults_summary() or 'none'})",
        flush=True,
    )
    serve(config)
    return 0
