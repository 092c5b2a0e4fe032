"""``backend=ray`` end to end on a local Ray cluster (2 CPUs; a second node simulated for node loss).

Each test is one short training run; together they stay within a few minutes
of CI on 2 cores. Longer runs and timings are in benchmarks/ray_scaling.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path

import pytest
import ray
import torch
from loopback_lab import serve_mock_lab
from ray_helpers import LAB_TOKEN, lab_synthesis, metrics, quickstart_tiny, trained_groups

from labrl.errors import LearnerLostError, PlacementError
from labrl.harness.backends.ray.actors import Control, LearnerActor
from labrl.harness.backends.ray.backend import actor_name, remote_warm_start
from labrl.harness.config import build_run_config
from labrl.harness.pipeline.checkpoint import STATE_FILE, latest_checkpoint
from labrl.harness.pipeline.runner import train

pytestmark = pytest.mark.timeout(900)


async def test_the_learner_actor_warm_start_stops_when_the_driver_is_asked_to(ray_cluster, tmp_path):
    """The learner actor runs the shared ``parts.warm_start``; the driver's stop reaches it through Control."""
    cfg = build_run_config(
        quickstart_tiny(tmp_path / "ws", backend="ray")
        | {"sft": {"enabled": True, "steps": 3, "batch_size": 2, "num_prompts": 4}}
    )
    control = ray.remote(Control).options(num_cpus=0).remote()
    learner = ray.remote(LearnerActor).options(num_cpus=0.1).remote(cfg.model_dump(mode="json"))
    try:
        records, sft_s = await remote_warm_start(learner, control, should_stop=lambda: False)
        assert [r["sft_step"] for r in records] == [1, 2, 3] and sft_s > 0
        records, _ = await remote_warm_start(learner, control, should_stop=lambda: True)
        assert records == [] and await control.stop_requested.remote()
    finally:
        for handle in (learner, control):
            ray.kill(handle, no_restart=True)


def _trained_tokens(run_dir: Path) -> list[list[tuple[int, ...]]]:
    """Per step, the groups trained (by index) as sets; used with the learner's losses below."""
    return [sorted(step) for step in trained_groups(run_dir)]


async def test_quickstart_sync_under_ray_trains_the_same_batches_as_inprocess(ray_cluster, tmp_path):
    inproc = await train(build_run_config(quickstart_tiny(tmp_path / "inproc")))
    remote = await train(build_run_config(quickstart_tiny(tmp_path / "ray", backend="ray")))
    assert inproc["step"] == remote["step"] == 2 and remote["backend"] == "ray"
    assert _trained_tokens(tmp_path / "inproc") == _trained_tokens(tmp_path / "ray")
    a, b = metrics(tmp_path / "inproc"), metrics(tmp_path / "ray")
    for x, y in zip(a, b, strict=True):
        # same trajectories (rewards, token counts) and the same update (losses) at every step
        assert x["reward/mean"] == y["reward/mean"]
        assert x["learner/tokens"] == y["learner/tokens"]
        assert math.isclose(x["loss/total"], y["loss/total"], rel_tol=1e-5, abs_tol=1e-7)
        assert x["learner/version"] == y["learner/version"]
    assert remote["ray"]["groups_played"] == 4
    assert "ray: env 1/1" in b[-1]["health"]
    # a per-step delta: a step whose groups all arrived before the previous record can read 0 under load
    assert sum(r["ray/group_payload_bytes"] for r in b) > 0


async def test_quickstart_pipeline_under_ray_is_in_the_inprocess_band(ray_cluster, tmp_path):
    """Pipeline mode (in-flight weight updates, bounded staleness) after the quickstart's format-only
    warm start: under Ray every group is trained once, the policy version advances one per step, and
    the rewards are in-process's within sampling noise. The full quickstart's band (200 steps,
    held-out accuracy) is the benchmark's: benchmarks/quickstart_seeds.py --set backend=ray."""
    pipeline = {"mode": "pipeline", "total_steps": 12, "max_staleness": 1, "max_concurrent_episodes": 32}
    warm = {"sft": {"enabled": True, "steps": 200, "batch_size": 16, "lr": 3e-3, "num_prompts": 256}}
    runs = {}
    for backend in ("inprocess", "ray"):
        cfg = quickstart_tiny(tmp_path / backend, backend=backend, **pipeline) | warm
        summary = await train(build_run_config(cfg))
        assert summary["step"] == 12
        _accounted(tmp_path / backend, 12, 2)
        runs[backend] = metrics(tmp_path / backend)
    for rows in runs.values():
        assert [r["learner/version"] for r in rows] == [rows[0]["learner/version"] + i for i in range(12)]
        assert (
            max(r["staleness/max"] for r in rows) <= 2
        )  # the bound (1), or one batch late when out of order
    mean = {b: sum(r["reward/mean"] for r in rows) / len(rows) for b, rows in runs.items()}
    # 96 episodes each at p ~ 0.25 (one of 4 candidates, on format): the difference has SE ~ 0.06
    assert mean["ray"] > 0.05, mean  # on format: the warm start and the weights reached the sampler actor
    assert abs(mean["ray"] - mean["inprocess"]) <= 0.2, mean


async def test_sampler_actor_fronts_an_sglang_server_and_moves_its_weights(ray_cluster, tmp_path):
    """``sampler.kind: sglang`` under Ray, against the fake SGLang server (a real HTTP server speaking
    SGLang's API, serving with the local sampler on CPU): the sampler actor fronts it, the server starts
    from other weights than the learner's, and every policy version reaches it in order, in flight
    (retract, update from disk, continue); the behaviour log-probs are the learner's."""
    from sglang_pipeline_check import other_init_checkpoint

    from labrl.testing.fake_sglang_server import ServerThread, local_fake_server

    run = tmp_path / "sglang"
    steps = 3
    base = quickstart_tiny(run, backend="ray", mode="pipeline", total_steps=steps, max_staleness=1)
    model_cfg = build_run_config(base).model.resolve()
    server = local_fake_server(str(other_init_checkpoint(model_cfg, tmp_path / "served")), tick_delay_s=0.005)
    with ServerThread(server.app) as url:
        sampler = {
            "kind": "sglang",
            "sglang": {"urls": [url], "export_dir": str(run / "exports")},
            "max_new_tokens": 6,
        }
        summary = await train(build_run_config(base | {"sampler": sampler}))
    assert summary["step"] == steps and summary["backend"] == "ray"
    _accounted(run, steps, 2)
    updates = [e for e in server.log if e.startswith("update_")]
    assert updates == [f"update_disk:{v}" for v in range(steps + 1)], server.log
    for i, entry in enumerate(server.log):
        if entry.startswith("update_"):
            assert server.log[i - 1] == "pause:retract" and server.log[i + 1] == "continue"
    # the server generated with the learner's weights (the first sync replaced its own): behaviour
    # and learner log-probs of the trained tokens agree to float error, not to a different model's
    assert all(r["mismatch/abs_log_ratio_mean"] < 1e-3 for r in metrics(run)), [
        r["mismatch/abs_log_ratio_mean"] for r in metrics(run)
    ]


async def _kill_when(run_dir: Path, role: str, ready, *, poll_s: float = 0.2) -> int:
    """Kill ``role``'s actor (Ray restarts it) once ``ready()``; returns the killed process's pid."""
    while True:
        try:
            actor = ray.get_actor(actor_name(str(run_dir), role))
            if await ready():
                pid = await actor.pid.remote()
                ray.kill(actor, no_restart=False)
                return pid
        except ValueError:  # not created yet
            pass
        await asyncio.sleep(poll_s)


def _lab_call_pending(run_dir: Path):
    """An async predicate: an episode of the run waits on its lab job right now (False before the gateway is up)."""

    async def pending() -> bool:
        try:
            gateway = ray.get_actor(actor_name(str(run_dir), "gateway"))
        except ValueError:  # not created yet
            return False
        return (await gateway.stats.remote()).get("lab_calls_pending", 0) > 0

    return pending


async def _wait_until(ready, *, poll_s: float = 0.2) -> None:
    while not await ready():
        await asyncio.sleep(poll_s)


def _accounted(run_dir: Path, steps: int, batch_groups: int) -> None:
    """Nothing trained twice, nothing lost: every group started is trained, buffered, dropped or saved for resume."""
    trained = [g for step in trained_groups(run_dir) for g in step]
    assert len(trained) == len(set(trained)) == steps * batch_groups
    state = torch.load(latest_checkpoint(run_dir) / STATE_FILE, weights_only=False)
    counters = state["buffer"]["counters"]
    assert state["next_group_index"] == counters["groups_added"] + len(state["inflight"])
    assert counters["groups_kept"] == len(trained) + len(state["buffer"]["groups"])


async def test_lab_env_worker_and_sampler_killed_mid_run(ray_cluster, tmp_path):
    """A killed env worker: its groups replay, episodes with a pending job resume and re-attach; a killed
    sampler: its requests are re-issued to the restarted actor, which re-syncs first. No job submitted twice."""
    run = tmp_path / "lab"
    # Six steps, so the run needs the restarted sampler: when step 1 is done, admission (max_staleness 2,
    # two groups a batch) has let at most 2 + 6 of the 12 groups start, so at least four start after the
    # kill and each needs a generation from the only sampler. With four steps every group could have
    # been generated before the kill, and the run could end before Ray had the sampler back.
    steps = 6
    cfg = build_run_config(
        lab_synthesis(run, latency_s=1.5, steps=steps, ray={"env_workers": 2, "samplers": 1})
        | {"env": {"id": "test/synthesis-anytext-v0", "options": {"mock_latency_s": 1.5, "run_id": "kill"}}}
    )

    async def one_step_done() -> bool:
        return (run / "metrics.jsonl").exists() and bool((run / "metrics.jsonl").read_text().strip())

    training = asyncio.ensure_future(train(cfg))
    killed_env = await _kill_when(run, "env0", _lab_call_pending(run))
    killed_sampler = await _kill_when(run, "sampler0", one_step_done)
    summary = await training
    assert summary["step"] == steps and killed_env > 0 and killed_sampler > 0
    _accounted(run, steps, 2)
    r = summary["ray"]
    assert r["env_worker_failures"] >= 1 and r["groups_replayed"] >= 1
    assert r["episodes_resumed"] >= 1  # it had a pending lab job, and was resumed from its transcript
    assert r["jobs_reattached"] >= 1
    assert r["turns_replayed"] >= r["episodes_resumed"]
    assert r["sampler_restarts"] == 1 and r["env_worker_restarts"] >= 1
    # the mock lab's own counts: one submission and one run per job, one job per key
    assert r["mock/max_submits_per_job"] == 1 and r["mock/max_runs_per_job"] == 1
    assert r["mock/jobs"] == r["mock/keys"]
    last = metrics(run)[-1]
    assert "samplers 1/1" in last["health"]
    # the restarted sampler served the current policy: the last step's tokens respect the admission
    # bound, except episodes replayed after the kill (resumed from transcripts sampled before it),
    # which are trained with the corrections and counted, never dropped
    if last["staleness/max"] > 2:
        over, replayed = last["staleness/over_max_episodes"], last["staleness/over_max_replayed_episodes"]
        assert 0 < over + replayed and replayed <= r["groups_replayed"] * 2  # group_size 2


async def test_a_lost_node_restarts_its_env_worker_elsewhere(ray_cluster, tmp_path):
    run = tmp_path / "node"
    node = ray_cluster.add_node(num_cpus=1, resources={"envnode": 1})
    ray_cluster.wait_for_nodes()
    cfg = build_run_config(
        lab_synthesis(
            run, latency_s=1.5, steps=3, ray={"env_workers": 1, "env_worker_resources": {"envnode": 1}}
        )
        | {"env": {"id": "test/synthesis-anytext-v0", "options": {"mock_latency_s": 1.5, "run_id": "node"}}}
    )
    training = asyncio.ensure_future(train(cfg))
    # the only node with "envnode" holds the env worker; lose it while a job is pending
    await _wait_until(_lab_call_pending(run))
    ray_cluster.add_node(num_cpus=1, resources={"envnode": 1})  # where the worker can come back
    ray_cluster.remove_node(node, allow_graceful=False)
    summary = await training
    assert summary["step"] == 3
    _accounted(run, 3, 2)
    r = summary["ray"]
    assert r["env_worker_restarts"] >= 1 and r["episodes_resumed"] >= 1 and r["jobs_reattached"] >= 1
    assert r["mock/max_submits_per_job"] == 1 and r["mock/max_runs_per_job"] == 1


async def test_a_run_lost_with_its_head_node_resumes_pending_lab_jobs_from_disk(
    ray_cluster, tmp_path, monkeypatch
):
    """The driver and the lab gateway (a run's part on the head node) go while lab jobs are pending,
    and every actor with them; the lab (a real HTTP server) stays. The rerun plays the groups that were
    in flight from the transcripts on disk and re-attaches their jobs: none is paid for twice."""
    monkeypatch.setenv("LABRL_MOCK_LAB_TOKEN", LAB_TOKEN)
    monkeypatch.setenv("LABRL_LAB_API_KEY", LAB_TOKEN)
    run = tmp_path / "head"
    with serve_mock_lab(tmp_path / "lab", latency_median_s=2.0, latency_sigma=0.1) as (url, asgi):
        options = {"lab_url": url, "journal_path": str(tmp_path / "journal.sqlite"), "run_id": "head"}
        cfg = build_run_config(
            lab_synthesis(run, latency_s=0.0, steps=3, ray={"env_workers": 1})
            | {"env": {"id": "test/synthesis-anytext-v0", "options": options}}
        )
        training = asyncio.ensure_future(train(cfg))
        await _wait_until(_lab_call_pending(run))
        training.cancel()  # the run ends here, and the gateway's memory with it
        with contextlib.suppress(asyncio.CancelledError):
            await training
        assert (run / "lab_transcripts.sqlite").exists()
        summary = await train(cfg)
        lab = asgi.app.state.lab.stats()
    assert summary["step"] == 3
    _accounted(run, 3, 2)
    r = summary["ray"]
    # counters absent: nothing was resumed (the transcripts were lost with the gateway)
    assert r.get("episodes_resumed", 0) >= 1 and r.get("jobs_reattached", 0) >= 1
    assert max(lab["submits_by_key"].values()) == 1 and lab["max_runs_per_job"] == 1


async def test_losing_the_learner_stops_the_run_with_a_resumable_checkpoint(ray_cluster, tmp_path):
    run = tmp_path / "learner"
    cfg = build_run_config(quickstart_tiny(run, backend="ray", total_steps=50, checkpoint_every=1))

    async def two_steps_done() -> bool:
        return (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2

    training = asyncio.ensure_future(train(cfg))
    while not await two_steps_done():
        await asyncio.sleep(0.2)
    ray.kill(ray.get_actor(actor_name(str(run), "learner")), no_restart=True)
    with pytest.raises(LearnerLostError, match=r"rerun the same command to resume from .*step_0000\d\d"):
        await training
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and int(ckpt.name.removeprefix("step_")) >= 2
    state = torch.load(ckpt / STATE_FILE, weights_only=False)
    assert state["step"] == len(state["trained_groups"]) // 2  # a consistent checkpoint: 2 groups per step


@pytest.mark.timeout(180)  # a hang (Ray waiting on an unplaceable actor) fails here
@pytest.mark.parametrize(
    ("ray_cfg", "message"),
    [
        ({"env_worker_resources": {"lab_credentials": 1}}, "lab_credentials is on no node"),
        ({"learner_gpus": 1}, "GPU is on no node"),
        ({"samplers": 2, "cpus_per_sampler": 8}, "no node has that much"),
        ({"env_workers": 64, "cpus_per_env_worker": 1}, "the run needs 66 CPU"),
    ],
)
async def test_impossible_placements_fail_fast_with_a_message(ray_cluster, tmp_path, ray_cfg, message):
    cfg = build_run_config(
        quickstart_tiny(tmp_path / "bad", backend="ray") | {"ray": {"placement_timeout_s": 600} | ray_cfg}
    )
    with pytest.raises(PlacementError, match=message):
        await train(cfg)
    assert not [a for a in ray.util.list_named_actors() if str(tmp_path) in a]  # nothing was started
    # nothing trained or checkpointed; the failure is in the run's errors log with its message
    assert sorted(p.name for p in (tmp_path / "bad").iterdir()) == [
        "config.yaml",
        "effective.json",
        "errors.jsonl",
    ]
    assert "PlacementError" in (tmp_path / "bad" / "errors.jsonl").read_text()
