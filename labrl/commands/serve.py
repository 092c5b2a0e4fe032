"""``labrl serve sglang --python PY --model PATH [sglang args]``: run a supervised SGLang server for labrl.

SGLang pins its own torch: install it in its own environment and pass that
environment's interpreter with ``--python`` (checked first: it must import
sglang); the learner's environment never installs sglang. Anything after
``--`` goes to SGLang unchanged, e.g.
``labrl serve sglang --python /opt/sglang/bin/python --model ckpt/ --tp 2 -- --mem-fraction-static 0.7``.
``--launcher`` replaces the whole ``PY -m sglang.launch_server`` command
(tests point it at ``python -m labrl.testing.fake_sglang_server``).
``--run-config RUN.yaml`` takes everything from that run's ``sampler.sglang``
block instead: ``launch_python``, ``launch_model_path``, ``launch_tp_size``,
``launch_args``, ``deterministic_inference``, and host/port from ``urls[0]``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any
from urllib.parse import urlsplit

from labrl.errors import ConfigError
from labrl.harness.samplers.sglang.launch import (
    DEFAULT_LAUNCHER,
    Supervisor,
    check_server_python,
    launcher_for,
    server_command,
)
from labrl.ports import ephemeral_port_range, restart_port_warning


def add_parser(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="launch and supervise an inference server (sglang)")
    sub = serve.add_subparsers(dest="serve_command", metavar="ENGINE", required=True)
    p = sub.add_parser("sglang", help="SGLang with the flags labrl needs; extra args go to SGLang")
    p.add_argument("--model", help="HF checkpoint directory (see labrl.harness.models.hf_export)")
    p.add_argument("--run-config", help="run config whose sampler.sglang block says what to launch")
    p.add_argument("--host", default="127.0.0.1", help="address the server binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port the server listens on (default 30000)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /health_generate")
    p.add_argument(
        "--max-restarts", type=int, default=3, help="restarts after a crash before giving up (default 3)"
    )
    p.add_argument("--python", help="interpreter of the environment SGLang is installed in")
    p.add_argument("--tp", type=int, help="tensor-parallel size (SGLang's --tp-size)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="add --enable-deterministic-inference (SGLang ignores sampling_seed without it)",
    )
    p.add_argument(
        "--launcher", help="command that starts the server (default: PYTHON -m sglang.launch_server)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments passed to SGLang unchanged")
    p.set_defaults(func=cmd_sglang)


def cmd_sglang(args: argparse.Namespace) -> int:
    extra = [a for a in getattr(args, "extra", []) if a != "--"]
    if args.run_config:
        cmd, url, python = _from_run_config(args.run_config, extra)
        args.python = python
    else:
        if args.model is None:
            raise ConfigError("labrl serve sglang needs --model (or --run-config)")
        if args.launcher and args.python:
            raise ConfigError(
                "give --python (an SGLang environment) or --launcher (a whole command), not both"
            )
        launcher = args.launcher or (launcher_for(args.python) if args.python else DEFAULT_LAUNCHER)
        cmd = server_command(
            args.model,
            args.host,
            args.port,
            extra,
            launcher,
            deterministic=args.deterministic,
            tp_size=args.tp,
        )
        url = f"http://{args.host}:{args.port}"
    port = urlsplit(url).port
    warning = restart_port_warning(port, ephemeral_port_range()) if port is not None else None
    if warning and args.max_restarts > 0:
        print(f"labrl serve: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    if args.python:
        print(f"labrl serve: {args.python} has sglang {check_server_python(args.python)}", file=sys.stderr)
    sup = Supervisor(cmd, url, args.ready_timeout, args.max_restarts)

    def _stop(signum: int, _frame: Any) -> None:
        sup.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    try:
        code = sup.run()
    except KeyboardInterrupt:
        sup.stop()
        return 130
    finally:
        sup.stop()
    for line in sup.log:
        print(f"labrl serve: {line}", file=sys.stderr)
    return code


def _from_run_config(path: str, extra: list[str]) -> tuple[list[str], str, str]:
    """(command, url, interpreter) of the server a run config's ``sampler.sglang`` block describes."""
    from labrl.harness.config import load_run_config
    from labrl.harness.samplers.sglang.launch import launch_command
    from labrl.harness.samplers.sglang.sampler import SGLangSamplerConfig

    block = SGLangSamplerConfig.model_validate(load_run_config(path).sampler.sglang.model_dump())
    cmd = launch_command(block) + extra
    return cmd, block.urls[0].rstrip("/"), block.launch_python  # type: ignore[return-value]
