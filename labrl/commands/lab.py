"""``labrl lab ...``: run the mock autonomous lab, and look at any lab by hand.

::

    export LABRL_MOCK_LAB_TOKEN=secret          # the token the mock lab *accepts*
    labrl lab serve-mock --state-dir runs/mock-lab --port 8765 --latency-median 2 \\
        --error-rate 0.1 --hang-rate 0.05 --duplicate-rate 0.02

    export LABRL_LAB_API_KEY=secret             # the key a client *sends* (same value for the mock)
    labrl lab submit --url http://127.0.0.1:8765 '{"kind": "echo", "x": 1}' --wait 10
    labrl lab status --url http://127.0.0.1:8765 JOB_ID --wait 10
    labrl lab journal runs/lab/journal.sqlite --limit 20

    labrl lab serve-madsci-node --port 2000     # the mock lab as a MADSci node (extra: labrl[madsci])

``submit`` uses the idempotency key ``--key`` (default: derived from the
request, so submitting the same request twice is one job); both print the
job's status as JSON. ``journal`` prints a journal's counts by state and its
newest entries; ``--fresh`` sets an empty or corrupt journal aside and
starts a new one (without it such a journal is an error). ``serve-madsci-node``
serves a lab as a MADSci node (``labrl.interop.madsci_node``): the lab at
``--lab-url``, or else a mock lab it starts as a child process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from labrl.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser("lab", help="run the mock lab; submit, status and journal to look at a lab")
    sub = lab.add_subparsers(dest="lab_command", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser("serve-mock", help="serve the mock lab's REST API on loopback")
    serve.add_argument(
        "--config", type=Path, help="a JSON file with MockLabConfig fields (flags override it)"
    )
    serve.add_argument("--host", default=None, help="loopback address to bind (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=None, help="port to listen on (default 8765; 0 = any free)"
    )
    serve.add_argument("--state-dir", type=Path, default=None, help="where jobs are kept across restarts")
    serve.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    serve.add_argument(
        "--latency-median", type=float, default=None, dest="latency_median_s", help="median job time in s (2)"
    )
    serve.add_argument(
        "--latency-sigma", type=float, default=None, help="log-normal spread of job times (0.5)"
    )
    serve.add_argument("--instruments", type=int, default=None, help="jobs run at once (default unlimited)")
    serve.add_argument("--seed", type=int, default=None, help="seed of latencies, faults and results (0)")
    for name, text in FAULT_HELP.items():
        serve.add_argument(
            "--" + name.replace("_", "-"), type=float, default=None, dest="fault_" + name, help=text
        )
    serve.set_defaults(func=_serve_mock)

    submit = sub.add_parser("submit", help="submit one job to a lab and print its status (JSON)")
    _lab_client_args(submit)
    submit.add_argument("request", help="the job request: inline JSON, or @FILE holding it")
    submit.add_argument(
        "--key", default=None, help="idempotency key (default: lab-cli-<hash of the request>)"
    )
    submit.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the job to finish (0)")
    submit.set_defaults(func=_submit)

    status = sub.add_parser("status", help="print a job's status (JSON)")
    _lab_client_args(status)
    status.add_argument("job_id", help="the job id submit printed")
    status.add_argument("--key", default="", help="the job's idempotency key (shown in the output only)")
    status.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the job to finish (0)")
    status.set_defaults(func=_status)

    journal = sub.add_parser("journal", help="a job journal's counts by state and its newest entries")
    journal.add_argument("path", type=Path, help="the journal file (e.g. runs/lab/journal.sqlite)")
    journal.add_argument("--limit", type=int, default=20, help="newest entries to list (default 20; 0 = all)")
    journal.add_argument(
        "--fresh", action="store_true", help="set an empty or corrupt journal aside and start a new one"
    )
    journal.add_argument("--json", action="store_true", help="print JSON instead of a table")
    journal.set_defaults(func=_journal)

    node = sub.add_parser(
        "serve-madsci-node", help="serve a lab (default: a fresh mock lab) as a MADSci node on loopback"
    )
    node.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    node.add_argument("--port", type=int, default=2000, help="port of the node (default 2000, MADSci's)")
    node.add_argument("--lab-url", default=None, help="a labrl REST lab; default: start a mock lab")
    node.add_argument(
        "--api-key-env",
        default="LABRL_LAB_API_KEY",
        help="environment variable holding the lab's key (default LABRL_LAB_API_KEY)",
    )
    node.add_argument(
        "--state-dir", type=Path, default=Path("runs/mock-lab-madsci"), help="the started mock lab's state"
    )
    node.add_argument(
        "--latency-median", type=float, default=2.0, dest="latency_median_s", help="mock job time in s (2)"
    )
    node.set_defaults(func=_serve_madsci_node)


FAULT_HELP = {
    "error_rate": "fraction of calls answered 500 (default 0)",
    "error_after_commit": "of those, the fraction that fail after the job was committed (0.5)",
    "hang_rate": "fraction of calls that hang for --hang-s (default 0)",
    "hang_s": "how long a hung call hangs, in s (30)",
    "drop_rate": "fraction of connections dropped without an answer (default 0)",
    "duplicate_rate": "fraction of completion events sent twice (default 0)",
    "result_ttl_s": "results expire this many s after completion (default never)",
}


def _lab_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the lab's base URL, e.g. http://127.0.0.1:8765")
    parser.add_argument(
        "--api-key-env",
        default="LABRL_LAB_API_KEY",
        help="environment variable holding the key the client sends (default LABRL_LAB_API_KEY)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP call (default 10)")


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


def _read_request(raw: str) -> dict:
    text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the request is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(request, dict):
        raise ConfigError('the request must be a JSON object, e.g. \'{"kind": "echo"}\'')
    return request


def _client(args: argparse.Namespace):  # -> RestLabAdapter (imports deferred: keeps `labrl --help` light)
    from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

    config = RestLabConfig(
        base_url=args.url, api_key_env=args.api_key_env, call_timeout_s=args.timeout, max_attempts=2
    )
    return RestLabAdapter(config)


def _submit(args: argparse.Namespace) -> int:
    import asyncio

    from labrl.lab_adapters.protocol import request_hash

    request = _read_request(args.request)
    key = args.key or f"lab-cli-{request_hash(request)[:16]}"

    async def go() -> str:
        async with _client(args) as lab:
            status = await lab.submit_status(request, key)
            if args.wait > 0 and not status.state.terminal:
                status = await lab.wait(status.ref, args.wait)
            return status.model_dump_json(indent=2)

    print(asyncio.run(go()))
    return 0


def _status(args: argparse.Namespace) -> int:
    import asyncio

    from labrl.lab_adapters.protocol import JobRef

    async def go() -> str:
        async with _client(args) as lab:
            job = JobRef(job_id=args.job_id, idempotency_key=args.key)
            status = await (lab.wait(job, args.wait) if args.wait > 0 else lab.status(job))
            return status.model_dump_json(indent=2)

    print(asyncio.run(go()))
    return 0


def _journal(args: argparse.Namespace) -> int:
    import asyncio

    from labrl.errors import LabJournalError
    from labrl.lab_adapters.job_journal import Journal

    if not args.path.exists():
        raise LabJournalError(f"no journal at {args.path}")

    async def go() -> tuple[dict, list, Path | None]:
        journal = Journal(args.path, start_fresh=args.fresh)
        try:
            return await journal.counts(), await journal.entries(args.limit or None), journal.set_aside
        finally:
            await journal.close()

    counts, entries, set_aside = asyncio.run(go())
    if args.json:
        rows = [e.model_dump(exclude={"request"}) for e in entries]
        print(json.dumps({"path": str(args.path), "counts": counts, "entries": rows}, indent=2))
        return 0
    if set_aside is not None:
        print(f"the old journal was set aside as {set_aside}; this one is new")
    total = sum(counts.values())
    print(
        f"{args.path}: {total} job(s): "
        + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none")
    )
    for e in entries:
        handed = "acked" if e.acked else "delivered" if e.delivered else "open"
        error = f"  {e.error[:80]}" if e.error else ""
        print(f"  {e.state:<10} {handed:<9} {e.job_id or '-':<14} {e.key}{error}")
    return 0


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


def _serve_madsci_node(args: argparse.Namespace) -> int:
    import os
    import secrets

    from labrl.extras import import_extra

    node = import_extra("labrl.interop.madsci_node", "madsci")
    if args.lab_url is not None:
        print(f"MADSci node on http://{args.host}:{args.port} -> lab {args.lab_url}", flush=True)
        node.serve_node(args.port, args.lab_url, host=args.host, key_env=args.api_key_env)
        return 0
    from labrl.lab_adapters.mock import MockLabConfig, MockLabProcess

    token = os.environ.get(args.api_key_env) or secrets.token_hex(16)
    os.environ[args.api_key_env] = token  # the node's lab client reads it from here
    config = MockLabConfig(port=0, state_dir=args.state_dir, latency_median_s=args.latency_median_s)
    with MockLabProcess(config, token) as lab:
        print(f"MADSci node on http://{args.host}:{args.port} -> mock lab {lab.url}", flush=True)
        node.serve_node(args.port, lab.url, host=args.host, key_env=args.api_key_env)
    return 0
