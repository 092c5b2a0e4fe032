"""Benchmark: a labrl env served over OpenEnv and the Open Reward Standard vs the in-process API.

One run per protocol, each in the protocol's own venv (the packages' pins conflict), then a merge:

    .venv-interop/openenv/bin/python benchmarks/serve.py --protocol openenv   # results/serve_openenv.json
    .venv-interop/ors/bin/python benchmarks/serve.py --protocol ors           # results/serve_ors.json
    .venv/bin/python benchmarks/serve.py --merge                              # one table, results/serve.json

The env is ``bench/wait-v0`` (``_serve_env.py``): 2-step episodes whose steps wait ``wait_s``
(1 s: the goal's env; 0 s: the protocol's overhead alone). For each load (``LOADS``: 1, 100 and
1,000 concurrent sessions, each playing its episodes one after another) the same episodes are
played in-process (``labrl.envs.make``, the baseline) and through the protocol's own client
against ``labrl envs serve`` of that env in a child process on localhost, one after the other.
Per path: episodes/s = episodes / wall time from the first session opened to the last closed;
p50/p99 of the step latency the caller waited; CPU ms per step = (user + system CPU seconds of
the serving process over the load, sessions opened and closed and resets included) / steps
(in-process: the benchmark process itself, the env and its driver); client CPU ms per step: the
same for the benchmark process driving the protocol's client. Memory per idle session =
(server RSS with ``--idle-sessions`` sessions open, each reset and idle, all at once - RSS after
one warm-up episode) / sessions. Client and server share the machine's cores.

Goals (issue 28): >= 90 % of the in-process episodes/s at 100 sessions of the 1 s env; 1,000
sessions held with no error (the idle-memory hold and the 1,000-session loads); server CPU per
step < 1 ms (the 100-session loads); memory per idle session reported.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _proc import cpu_seconds, rss_bytes  # beside this script
from _results import RESULTS, write_json
from _serve_clients import (
    IN_PROCESS,
    PROTOCOLS,
    TASKS_PER_SPLIT,
    Client,
    InProcessClient,
    protocol_client,
    require_protocol,
)
from _serve_env import ENV_ID, register_wait_env

from labrl.errors import MissingExtraError
from labrl.ports import free_port
from labrl.runtime import tune_gc_for_many_episodes

SERVER_SCRIPT = Path(__file__).with_name("_serve_env.py")
STARTUP_TIMEOUT_S = 60.0
#: after a load, before the server's CPU is read: closes the server finishes after the client's
SETTLE_S = 0.5
#: how long the idle sessions stay open before the server's RSS is read and each is checked
HOLD_S = 2.0
IDLE_SESSIONS = 1000
GOAL_THROUGHPUT_RATIO = 0.90
GOAL_SERVER_CPU_MS_PER_STEP = 1.0
GOAL_HELD_SESSIONS = 1000
#: distributions whose versions each run records
VERSIONS = ("openenv", "openreward", "fastapi", "uvicorn", "websockets", "aiohttp", "pydantic")


@dataclass(frozen=True)
class Load:
    sessions: int
    #: episodes each session plays, one after another
    episodes: int
    wait_s: float
    turns: int = 2

    @property
    def steps(self) -> int:
        return self.sessions * self.episodes * self.turns

    def options(self) -> dict[str, Any]:
        return {"wait_s": self.wait_s, "turns": self.turns}


#: the full run: 100-160 s per protocol on the shared 2-core machine (fewer episodes where sessions are many)
LOADS = (
    Load(sessions=1, episodes=5, wait_s=1.0),
    Load(sessions=100, episodes=5, wait_s=1.0),
    Load(sessions=1000, episodes=3, wait_s=1.0),
    Load(sessions=1, episodes=500, wait_s=0.0),
    Load(sessions=100, episodes=20, wait_s=0.0),
    Load(sessions=1000, episodes=3, wait_s=0.0),
)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _errors(errors: list[str]) -> dict[str, Any]:
    """The count and the most common kinds (a load of 1,000 sessions can fail 1,000 times alike)."""
    return {"errors": len(errors), "error_kinds": dict(collections.Counter(errors).most_common(5))}


async def play(client: Client, load: Load) -> dict[str, Any]:
    """``load`` through ``client``: every session opened, its episodes played in turn, closed."""
    latencies: list[float] = []
    errors: list[str] = []
    episodes = 0

    async def session(index: int) -> None:
        nonlocal episodes
        slot = client.slot()
        try:
            await slot.open()
            for episode in range(load.episodes):
                try:
                    await slot.episode(index * load.episodes + episode, load.turns, latencies)
                    episodes += 1
                except Exception as exc:  # counted and shown: a benchmark reports failures, never hides them
                    errors.append(_one_line(exc))
        except Exception as exc:
            errors.append(_one_line(exc))
        finally:
            try:
                await slot.close()
            except Exception as exc:
                errors.append(_one_line(exc))

    started = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(load.sessions)))
    wall_s = time.perf_counter() - started
    ms = np.asarray(latencies) * 1e3
    return {
        "episodes": episodes,
        "steps": len(latencies),
        "wall_s": round(wall_s, 3),
        "episodes_per_s": round(episodes / wall_s, 3),
        "step_p50_ms": round(float(np.percentile(ms, 50)), 3) if len(ms) else None,
        "step_p99_ms": round(float(np.percentile(ms, 99)), 3) if len(ms) else None,
        **_errors(errors),
    }


async def measure_load(client: Client, load: Load, pid: int) -> dict[str, Any]:
    """``play`` plus the CPU per step of the serving process ``pid`` and of this (the client) process."""
    me = os.getpid()
    server_before, client_before = cpu_seconds(pid), cpu_seconds(me)
    result = await play(client, load)
    await asyncio.sleep(SETTLE_S)
    spent = {"cpu": cpu_seconds(pid) - server_before, "client_cpu": cpu_seconds(me) - client_before}
    if pid == me:  # in-process: the one process is both
        del spent["client_cpu"]
    for name, seconds in spent.items():
        result[f"{name}_s"] = round(seconds, 3)
        result[f"{name}_ms_per_step"] = round(1e3 * seconds / result["steps"], 4) if result["steps"] else None
    return result


async def idle_memory(client: Client, sessions: int, pid: int) -> dict[str, Any]:
    """RSS of process ``pid`` per idle session: ``sessions`` reset and held at once, then checked."""
    await play(client, Load(sessions=1, episodes=1, wait_s=0.0, turns=1))  # warm-up: imports, first env
    rss_before = rss_bytes(pid)
    slots = [client.slot() for _ in range(sessions)]
    errors: list[str] = []

    async def guarded(step: Any) -> bool:
        try:
            await step
            return True
        except Exception as exc:
            errors.append(_one_line(exc))
            return False

    async def open_and_hold(index: int) -> bool:
        await slots[index].open()
        await slots[index].hold(index)
        return True

    started = time.perf_counter()
    opened = await asyncio.gather(*(guarded(open_and_hold(i)) for i in range(sessions)))
    open_s = time.perf_counter() - started
    await asyncio.sleep(HOLD_S)
    rss_held = rss_bytes(pid)
    alive = await asyncio.gather(
        *(guarded(slot.check()) for slot, ok in zip(slots, opened, strict=True) if ok)
    )
    await asyncio.gather(*(guarded(slot.close()) for slot in slots))
    return {
        "sessions": sessions,
        "held": sum(alive),
        "open_s": round(open_s, 3),
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_held_mib": round(rss_held / 2**20, 1),
        "kib_per_idle_session": round((rss_held - rss_before) / sessions / 1024, 1),
        **_errors(errors),
    }


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@asynccontextmanager
async def served(protocol: str, load: Load, max_sessions: int) -> AsyncIterator[Server]:
    """``labrl envs serve bench/wait-v0 --protocol P`` (``_serve_env.py``) in a child process."""
    port = free_port()
    argv = [
        sys.executable, str(SERVER_SCRIPT), "envs", "serve", ENV_ID, "--protocol", protocol,
        "--port", str(port), "--max-sessions", str(max_sessions), "--tasks-per-split", str(TASKS_PER_SPLIT),
        *(arg for key, value in load.options().items() for arg in ("-o", f"{key}={value}")),
    ]  # fmt: skip
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"},
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_healthy(url, process, stderr)
            yield Server(url=url, pid=process.pid)
        finally:
            process.terminate()
            await asyncio.to_thread(process.wait, 30)


async def _wait_healthy(url: str, process: subprocess.Popen[bytes], stderr: Any) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with httpx.AsyncClient(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                stderr.seek(0)
                raise RuntimeError(f"the server exited with {process.returncode}: {stderr.read()[-2000:]}")
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"no healthy server at {url} within {STARTUP_TIMEOUT_S:g} s")


def _by_env(loads: Iterable[Load]) -> dict[tuple[float, int], list[Load]]:
    """Loads grouped by the env options a server is started with (one server per group)."""
    groups: dict[tuple[float, int], list[Load]] = {}
    for load in loads:
        groups.setdefault((load.wait_s, load.turns), []).append(load)
    return groups


async def run(
    protocol: str, loads: Sequence[Load] = LOADS, idle_sessions: int = IDLE_SESSIONS
) -> dict[str, Any]:
    """Every load in-process and over ``protocol``, in turn; the idle memory of both (0: skipped)."""
    require_protocol(protocol)
    register_wait_env()
    pid = os.getpid()
    max_sessions = 2 * max([idle_sessions, *(load.sessions for load in loads)])  # closes finish late
    idle: dict[str, Any] = {}
    if idle_sessions:  # first: this process's RSS has not grown on the loads yet
        idle[IN_PROCESS] = await idle_memory(InProcessClient(loads[0].options()), idle_sessions, pid)
    rows = []
    for index, group in enumerate(_by_env(loads).values()):
        async with (
            served(protocol, group[0], max_sessions) as server,
            protocol_client(protocol, server.url) as client,
        ):
            if index == 0 and idle_sessions:
                idle[protocol] = await idle_memory(client, idle_sessions, server.pid)
            for load in group:
                baseline = await measure_load(InProcessClient(load.options()), load, pid)
                remote = await measure_load(client, load, server.pid)
                ratio = (
                    remote["episodes_per_s"] / baseline["episodes_per_s"]
                    if baseline["episodes_per_s"]
                    else None
                )
                row = {**asdict(load), "steps_requested": load.steps, IN_PROCESS: baseline, protocol: remote}
                rows.append({**row, "throughput_ratio": round(ratio, 4) if ratio is not None else None})
    return {"protocol": protocol, "rows": rows, "idle": idle}


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Each goal of issue 28 for one protocol's run: the value and met (None: not measured)."""
    protocol, rows = result["protocol"], result["rows"]
    at_100_1s = [r["throughput_ratio"] for r in rows if r["sessions"] == 100 and r["wait_s"] == 1.0]
    cpu_100 = [r[protocol]["cpu_ms_per_step"] for r in rows if r["sessions"] == 100]
    big_errors = sum(r[protocol]["errors"] for r in rows if r["sessions"] >= GOAL_HELD_SESSIONS)
    held = result["idle"].get(protocol)
    held_ok = None
    if held is not None and held["sessions"] >= GOAL_HELD_SESSIONS:
        held_ok = held["held"] == held["sessions"] and held["errors"] == 0 and big_errors == 0
    return {
        "throughput_ratio_100x1s": {
            "value": at_100_1s[0] if at_100_1s else None,
            "goal": f">= {GOAL_THROUGHPUT_RATIO}",
            "met": at_100_1s[0] >= GOAL_THROUGHPUT_RATIO if at_100_1s else None,
        },
        "sessions_held_1000": {
            "value": f"{held['held']}/{held['sessions']} held, {held['errors']} errors; "
            f"{big_errors} errors in the 1,000-session loads"
            if held
            else None,
            "goal": f"{GOAL_HELD_SESSIONS} held, no error",
            "met": held_ok,
        },
        "server_cpu_ms_per_step": {
            "value": max(cpu_100) if cpu_100 and None not in cpu_100 else None,
            "goal": f"< {GOAL_SERVER_CPU_MS_PER_STEP} (worst 100-session load)",
            "met": max(cpu_100) < GOAL_SERVER_CPU_MS_PER_STEP if cpu_100 and None not in cpu_100 else None,
        },
        "kib_per_idle_session": {
            "value": held["kib_per_idle_session"] if held else None,
            "goal": "reported",
            "met": held is not None,
        },
    }


def machine() -> dict[str, Any]:
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0], "versions": versions}


# -- printing ----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def table(results: Sequence[dict[str, Any]]) -> str:
    """One markdown table: per load, the in-process baseline of each run and its protocol."""
    lines = [
        "| sessions | wait | episodes | path | episodes/s | % of in-process | step p50 (ms) | step p99 (ms) "
        "| CPU ms/step | client CPU ms/step | errors |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted(
        {(r["wait_s"], r["sessions"]) for res in results for r in res["rows"]}, key=lambda k: (-k[0], k[1])
    )
    for wait_s, sessions in keys:
        for res in results:
            protocol = res["protocol"]
            for row in (r for r in res["rows"] if (r["wait_s"], r["sessions"]) == (wait_s, sessions)):
                for path, label in ((IN_PROCESS, f"in-process ({protocol} run)"), (protocol, protocol)):
                    m = row[path]
                    share = 100.0 if path == IN_PROCESS else (row["throughput_ratio"] or 0) * 100
                    lines.append(
                        f"| {sessions:,} | {wait_s:g} s | {m['episodes']:,} | {label} | {m['episodes_per_s']:,.2f} "
                        f"| {share:.1f} | {_fmt(m['step_p50_ms'], '.2f')} | {_fmt(m['step_p99_ms'], '.2f')} "
                        f"| {_fmt(m['cpu_ms_per_step'], '.3f')} | {_fmt(m.get('client_cpu_ms_per_step'), '.3f')} "
                        f"| {m['errors']} |"
                    )
    return "\n".join(lines)


def idle_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| path | sessions held | open time (s) | RSS before (MiB) | RSS held (MiB) | KiB per idle session | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for path, m in res["idle"].items():
            label = f"in-process ({res['protocol']} run)" if path == IN_PROCESS else f"{path} server"
            lines.append(
                f"| {label} | {m['held']:,}/{m['sessions']:,} | {m['open_s']:.2f} | {m['rss_before_mib']:.1f} "
                f"| {m['rss_held_mib']:.1f} | {m['kib_per_idle_session']:.1f} | {m['errors']} |"
            )
    return "\n".join(lines)


def goals_table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| protocol | goal | target | value | met |", "|---|---|---|---|---|"]
    for res in results:
        for name, goal in res["goals"].items():
            met = {True: "met", False: "**not met**", None: "not measured"}[goal["met"]]
            lines.append(f"| {res['protocol']} | {name} | {goal['goal']} | {_fmt(goal['value'])} | {met} |")
    return "\n".join(lines)


def show(results: Sequence[dict[str, Any]]) -> None:
    for res in results:
        for row in res["rows"]:
            for path in (IN_PROCESS, res["protocol"]):
                if row[path]["errors"]:
                    where = f"{res['protocol']} run, {path}, {row['sessions']} x {row['wait_s']:g} s"
                    print(f"{where}: {row[path]['error_kinds']}")
    print(table(results), end="\n\n")
    print(idle_table(results), end="\n\n")
    print(goals_table(results))


def merge() -> dict[str, Any]:
    """``serve_openenv.json`` and ``serve_ors.json`` as one result (``serve.json``)."""
    runs = {}
    for protocol in PROTOCOLS:
        path = RESULTS / f"serve_{protocol}.json"
        if not path.exists():
            raise SystemExit(f"serve.py: error: {path} is missing: run serve.py --protocol {protocol} first")
        runs[protocol] = json.loads(path.read_text())
    return {"runs": runs}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--protocol", choices=PROTOCOLS, help="measure this protocol against in-process")
    which.add_argument("--merge", action="store_true", help="one table of both protocols' results")
    parser.add_argument(
        "--idle-sessions",
        type=int,
        default=IDLE_SESSIONS,
        help="sessions held for the memory per session (0: skip)",
    )
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge()
        show(list(merged["runs"].values()))
        print(f"wrote {write_json('serve', merged)}")
        return 0
    try:
        require_protocol(args.protocol)
    except MissingExtraError as exc:
        print(f"serve.py: error: {exc}", file=sys.stderr)
        return 2
    tune_gc_for_many_episodes()  # as the labrl CLI does for the server (labrl.runtime)
    load_before = os.getloadavg()
    started = time.perf_counter()
    result = asyncio.run(run(args.protocol, LOADS, args.idle_sessions))
    result["goals"] = goals(result)
    result["machine"] = {
        **machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    show([result])
    print(f"machine load (1/5/15 min) before {load_before}, after {result['machine']['load_after']}; "
          f"{result['machine']['wall_s']} s")  # fmt: skip
    print(f"wrote {write_json(f'serve_{args.protocol}', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
