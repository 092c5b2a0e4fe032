"""``labrl serve sglang --model PATH [sglang args]``: run a supervised SGLang server for labrl.

Anything after ``--`` goes to SGLang unchanged,
e.g. ``labrl serve sglang --model ckpt/ --port 30000 -- --tp-size 2``.
``--launcher`` replaces ``python -m sglang.launch_server`` (tests point it at
``python -m labrl.harness.samplers.fake_server``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from labrl.harness.samplers.sglang_launch import DEFAULT_LAUNCHER, Supervisor, server_command


def add_parser(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="launch and supervise an inference server (sglang)")
    sub = serve.add_subparsers(dest="serve_command", metavar="ENGINE", required=True)
    p = sub.add_parser("sglang", help="SGLang with the flags labrl needs; extra args go to SGLang")
    p.add_argument("--model", required=True, help="HF checkpoint directory (see labrl.harness.hf_export)")
    p.add_argument("--host", default="127.0.0.1", help="address the server binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port the server listens on (default 30000)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /health_generate")
    p.add_argument(
        "--max-restarts", type=int, default=3, help="restarts after a crash before giving up (default 3)"
    )
    p.add_argument("--launcher", default=DEFAULT_LAUNCHER, help="command that starts the server")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments passed to SGLang unchanged")
    p.set_defaults(func=cmd_sglang)


def cmd_sglang(args: argparse.Namespace) -> int:
    extra = [a for a in getattr(args, "extra", []) if a != "--"]
    cmd = server_command(args.model, args.host, args.port, extra, args.launcher)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    sup = Supervisor(cmd, f"http://{args.host}:{args.port}", args.ready_timeout, args.max_restarts)

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
