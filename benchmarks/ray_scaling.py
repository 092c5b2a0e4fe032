"""Env-bound rollouts on Ray vs in-process: episodes/s, overhead per episode, object-store traffic, a worker killed.

Workload: a single-turn env whose step waits a lognormal latency (median
``--latency-p50`` = 1 s, sigma 0.5, drawn per episode from the task seed and
the member index, so both modes wait the same), a tiny MoE ``LocalSampler``
generating 2 tokens, groups of ``G`` episodes. The rollout plane of a run is
measured, not the learner: groups are played through the orchestrator's
``play_group`` of each backend (in-process: ``rollout_group`` over one asyncio
loop; Ray: ``EnvWorkerPool`` over env worker actors and a sampler actor, the
actors of ``labrl train ... backend=ray``).

For N in ``--workers`` (1 2 4): ``N x --groups-per-worker`` groups in flight
on N env workers, against in-process with the same groups in flight (equal
concurrency, the baseline of the same run), ``--repeats`` pairs in alternating
order. Ray overhead = 1 - in-process wall / Ray wall per pair, reported as the
median and the range over the pairs; per episode = (Ray wall - in-process
wall) / episodes, from the median walls.
Then the same with 4 workers and one killed mid-run (Ray restarts it; its
groups replay elsewhere): episodes finished per second over time, the dip and
the time until throughput is back to 90 % of the pre-kill mean.

    .venv/bin/python benchmarks/ray_scaling.py                       # ~10 min on 2 loaded cores
    .venv/bin/python benchmarks/ray_scaling.py --groups 12 --out /tmp/r.json   # shorter

Writes benchmarks/results/ray_scaling.json. CPU is shared with other work:
compare Ray with the in-process baseline of the same run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
ENV_ID = "bench/lognormal-sleep-v0"


def register_bench_env() -> None:
    """Ray's worker_process_setup_hook: the benchmark env in every worker."""
    from labrl.envs import register, registered_ids

    if ENV_ID not in registered_ids():
        register(ENV_ID, entry_point="ray_scaling:SleepEnv")


def _env_class():
    from labrl.envs import Env, EnvSpec, Message, Observation, StepResult, Task

    class SleepEnv(Env):
        """One turn; the step waits ``latency_p50 * exp(0.5 z)`` seconds (z per task seed and member)."""

        env_id: ClassVar[str] = ENV_ID

        def __init__(self, latency_p50: float = 1.0, sigma: float = 0.5) -> None:
            self.spec = EnvSpec(id=ENV_ID)
            self.latency_p50, self.sigma = latency_p50, sigma

        def make_task(self, split, seed: int) -> Task:
            return Task(env_id=ENV_ID, split=split, seed=seed, task_id=f"sleep-{seed}", prompt={})

        async def reset(self, task: Task) -> Observation:
            from labrl.harness.rollout.play import current_member

            self.task = task
            rng = random.Random(f"{task.seed}:{current_member.get()}")
            self.delay = self.latency_p50 * math.exp(self.sigma * rng.gauss(0.0, 1.0))
            return Observation(messages=(Message(role="user", content="wait"),))

        async def step(self, action) -> StepResult:
            await asyncio.sleep(self.delay)
            return StepResult(reward=float(len(action.text) % 2), done=True)

    return SleepEnv


def __getattr__(name: str):  # the registry imports ray_scaling:SleepEnv lazily (torch-free module import)
    if name == "SleepEnv":
        return _env_class()
    raise AttributeError(name)


TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 4, "moe_router_topk": 2, "max_sequence_length": 128}  # fmt: skip


def run_config(run_dir: Path, workers: int, group_size: int, latency: float) -> dict[str, Any]:
    return {
        "env": {"id": ENV_ID, "options": {"latency_p50": latency}},
        "model": {"preset": "tiny-moe", "overrides": TINY},
        "sampler": {"max_new_tokens": 2, "local": {"max_batch_size": 64}},
        "pipeline": {"group_size": group_size, "max_concurrent_episodes": 1024, "progress": False},
        "run_dir": str(run_dir),
        "backend": "ray",
        "ray": {"env_workers": workers, "samplers": 1, "learner_cpus": 0.1, "cpus_per_sampler": 0.1,
                "cpus_per_env_worker": 0.1},
    }  # fmt: skip


async def play(
    player, env, sampling, n_groups: int, in_flight: int, first: int, timeline: list[float]
) -> float:
    """Play ``n_groups`` groups with ``in_flight`` at a time; seconds taken; completion times into ``timeline``."""
    queue = list(range(first, first + n_groups))
    t0 = time.perf_counter()

    async def lane() -> None:
        while queue:
            index = queue.pop(0)
            sampling_i = sampling.model_copy(update={"seed": index * 1000})
            trajectories = await player(index, env.make_task("train", index), sampling_i)
            now = time.perf_counter() - t0
            timeline.extend([now] * len(trajectories))

    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return time.perf_counter() - t0


def recovery(timeline: list[float], kill_at: float, bin_s: float = 1.0) -> dict[str, Any]:
    """Episodes/s per bin; dip = lowest bin after the kill / pre-kill mean; recovery = first bin back at >= 90 %."""
    end = max(timeline)
    bins = [0] * (int(end / bin_s) + 1)
    for t in timeline:
        bins[int(t / bin_s)] += 1
    rate = [b / bin_s for b in bins]
    k = int(kill_at / bin_s)
    before = rate[1:k] or rate[:1]  # the first bin is the ramp-up
    pre = sum(before) / len(before)
    after = rate[k:-1] or rate[k:]
    low = min(after) if after else pre
    back = next((i for i in range(k + 1, len(rate) - 1) if rate[i] >= 0.9 * pre), None)
    return {
        "pre_kill_eps": pre,
        "dip_eps": low,
        "dip_frac": 1 - low / pre if pre else None,
        "recovery_s": (back * bin_s - kill_at) if back is not None else None,
        "rate_per_s": rate,
        "kill_at_s": kill_at,
    }


async def main_async(args) -> dict[str, Any]:
    import ray

    from labrl.envs import make
    from labrl.harness.backends.base import RunStart
    from labrl.harness.backends.parts import build_learner, build_sampler, build_tokenizer, run_components
    from labrl.harness.backends.ray.backend import RayBackend, actor_name
    from labrl.harness.backends.ray.clients import EnvWorkerPool
    from labrl.harness.config import build_run_config
    from labrl.harness.rollout.play import rollout_group

    register_bench_env()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    ray.init(
        address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING",
        runtime_env={"worker_process_setup_hook": "ray_scaling.register_bench_env"},
    )  # fmt: skip
    run_dir = Path(args.run_dir)
    top = max(args.workers)
    cfg = build_run_config(run_config(run_dir, top, args.group_size, args.latency_p50))
    tokenizer = build_tokenizer(cfg)
    sampling = run_components(cfg, tokenizer).sampling
    env = make(ENV_ID, latency_p50=args.latency_p50)
    t0 = time.perf_counter()
    make_env = lambda: make(ENV_ID, latency_p50=args.latency_p50)  # noqa: E731
    parts = await RayBackend().start(RunStart(cfg, tokenizer, make_env))
    startup_s = time.perf_counter() - t0
    workers = [ray.get_actor(actor_name(str(run_dir), f"env{i}")) for i in range(top)]
    gateway = ray.get_actor(actor_name(str(run_dir), "gateway"))
    # in-process: the same sampler config and weights, in this process
    learner = build_learner(cfg)
    local = await build_sampler(cfg, learner, tokenizer)

    async def inproc(index, task, s):
        return await rollout_group(make_env, task, local, tokenizer, s, args.group_size)

    weights = await parts.learner.export_weights()
    weights_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    await play(inproc, env, sampling, 2, 2, 10_000, [])  # warm-up both paths
    await play(EnvWorkerPool(workers, gateway).play, env, sampling, top, top, 20_000, [])
    rows = []
    next_index = 0
    for n in args.workers:
        in_flight = n * args.groups_per_worker
        groups = args.groups * n  # the same number of waves at every N
        pool = EnvWorkerPool(workers[:n], gateway)
        # --repeats pairs, the order alternating (ABBA...) so a drift in the machine's load hits both
        pairs, driver_cpu_s = [], 0.0
        for r in range(args.repeats):
            first_ray = r % 2 == 1
            times = {}
            for mode in ("ray", "inproc") if first_ray else ("inproc", "ray"):
                if mode == "ray":
                    cpu0 = time.process_time()
                    times[mode] = await play(pool.play, env, sampling, groups, in_flight, next_index, [])
                    driver_cpu_s += time.process_time() - cpu0  # the orchestrator's side of the rollout plane
                else:
                    times[mode] = await play(inproc, env, sampling, groups, in_flight, next_index, [])
            # both modes of a pair wait the same latency draws (the same tasks); the next pair new ones
            next_index += groups
            pairs.append((times["inproc"], times["ray"]))
        overheads = sorted(1 - b / r_ for b, r_ in pairs)
        base_s = statistics.median(b for b, _ in pairs)
        ray_s = statistics.median(r_ for _, r_ in pairs)
        episodes = groups * args.group_size
        payload = pool.payload_bytes / max(1, pool.counters["groups_played"])
        row = {
            "workers": n,
            "groups_in_flight": in_flight,
            "episodes": episodes,
            "repeats": args.repeats,
            "inprocess_eps": episodes / base_s,
            "ray_eps": episodes / ray_s,
            "overhead_frac": statistics.median(overheads),
            "overhead_frac_range": [overheads[0], overheads[-1]],
            "overhead_per_episode_ms": 1000 * (ray_s - base_s) / episodes,
            "driver_cpu_ms_per_episode": 1000 * driver_cpu_s / (episodes * args.repeats),
            "group_payload_bytes": payload,
            # per learner step of batch_groups groups: trajectories in, the batch to the learner (~ the same
            # tokens), the weights ref out (one copy per sampler actor node)
            "object_store_bytes_per_step": 2 * payload * args.batch_groups + weights_bytes,
        }
        rows.append(row)
        print(
            f"N={n}  in flight {in_flight} groups  in-process {row['inprocess_eps']:.1f} eps  "
            f"ray {row['ray_eps']:.1f} eps  overhead {100 * row['overhead_frac']:+.1f}% "
            f"[{100 * overheads[0]:+.1f}, {100 * overheads[-1]:+.1f}] over {args.repeats} pairs "
            f"({row['overhead_per_episode_ms']:+.1f} ms/episode)  driver CPU {row['driver_cpu_ms_per_episode']:.2f} ms/episode  group payload {payload / 1024:.1f} KiB",
            flush=True,
        )
    # one of `top` workers killed mid-run
    pool = EnvWorkerPool(workers, gateway)
    in_flight = top * args.groups_per_worker
    groups = 3 * args.groups * top
    timeline: list[float] = []
    started = time.perf_counter()

    async def killer() -> float:
        await asyncio.sleep(args.kill_after_s)
        ray.kill(workers[0], no_restart=False)
        return time.perf_counter() - started

    kill_task = asyncio.ensure_future(killer())
    wall = await play(pool.play, env, sampling, groups, in_flight, next_index, timeline)
    kill_at = await kill_task
    fault = recovery(timeline, kill_at) | {
        "workers": top,
        "episodes": len(timeline),
        "wall_s": wall,
        "groups_replayed": pool.counters["groups_replayed"],
        "episodes_rerun": pool.counters["episodes_rerun"],
    }
    print(
        f"kill 1 of {top} at {kill_at:.1f} s: pre-kill {fault['pre_kill_eps']:.1f} eps, dip to "
        f"{fault['dip_eps']:.1f} eps, back to 90% after {fault['recovery_s']} s; "
        f"{fault['groups_replayed']} group(s) replayed",
        flush=True,
    )
    await parts.close()
    return {
        "config": vars(args) | {"load_average_at_end": os.getloadavg()},
        "startup_s": startup_s,
        "weights_bytes": weights_bytes,
        "scaling": rows,
        "fault": fault,
        "note": "2 CPU cores; ratios within this run only (load average in config.load_average)",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--groups-per-worker", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="in-process/Ray pairs per N (median and range)")
    ap.add_argument("--groups", type=int, default=16, help="groups per measurement at N=1 (scaled with N)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-groups", type=int, default=8, help="groups per learner step (traffic estimate)")
    ap.add_argument("--latency-p50", type=float, default=1.0)
    ap.add_argument("--kill-after-s", type=float, default=4.0)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--run-dir", default="/tmp/labrl-ray-scaling")
    ap.add_argument("--out", default=str(HERE / "results" / "ray_scaling.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
