"""``RUN_DIR/episodes.jsonl``: one line per episode, consistent with metrics.jsonl, appended on resume."""

from __future__ import annotations

import json
from collections import Counter

from pipeline_fakes import BigramLearner, BigramSampler, LetterEnv

from labrl.harness.pipeline import Orchestrator, latest_checkpoint
from labrl.harness.pipeline.buffer import Group
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.pipeline.traces import (
    EPISODES_FILE,
    TRACE,
    EpisodeTraces,
    finished_record,
    read_episode_traces,
)
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import NO_VERSION, EpisodeTimeline, SamplingParams, Trajectory

G = 4  # group size


def make(run_dir, *, steps=5, **overrides):
    cfg = PipelineSection(
        mode="pipeline", batch_groups=3, group_size=G, total_steps=steps, eval_every=0, progress=False,
        max_staleness=2, **overrides,
    )  # fmt: skip
    records: list[dict] = []
    orch = Orchestrator(
        cfg,
        make_env=lambda: LetterEnv(latency_s=0.01, sigma=0.5, fail_every=7),
        sampler=BigramSampler(decode_delay=0.001),
        learner=BigramLearner(train_delay=0.01),
        tokenizer=ByteTokenizer(),
        sampling=SamplingParams(max_new_tokens=4),
        run_dir=run_dir,
        on_step=records.append,
    )
    return orch, records


async def test_each_decided_episode_has_one_consistent_line(tmp_path):
    orch, records = make(tmp_path)
    await orch.run()
    lines = (tmp_path / EPISODES_FILE).read_text().splitlines()
    traces = [json.loads(x) for x in lines]
    assert len({(t["group"], t["member"]) for t in traces}) == len(traces)
    # every finished episode is written except the trainable ones of groups still buffered at the end
    counters = orch.buffer.counters
    buffered = sum(len(g.trajectories) for g in orch.buffer.peek())
    assert len(traces) == counters["episodes"] - buffered
    fates = Counter(t["fate"] for t in traces)
    assert (
        fates["trained"] == sum(r["samples/trained"] for r in records) == records[-1]["samples/trained_total"]
    )
    assert fates["zero_variance"] > 0 and fates["untrainable"] > 0  # the run exercised both drops
    assert fates["zero_variance"] == G * counters["groups_zero_variance"]
    assert fates["untrainable"] == G * counters["groups_untrainable"]
    kept = set(orch.trained_groups) | {g.index for g in orch.buffer.peek()}
    assert {t["group"] for t in traces if t["fate"] == "masked"} <= kept
    # a trained group's members are its trained and masked episodes: G lines each
    per_group = Counter(t["group"] for t in traces if t["group"] in set(orch.trained_groups))
    assert set(per_group.values()) == {G}
    trained_groups = Counter(t["group"] for t in traces if t["fate"] == "trained")
    assert sorted(trained_groups) == sorted(orch.trained_groups)
    last_time = records[-1]["time_s"]
    for t in traces:
        assert 0 <= t["start_s"] <= t["end_s"] <= last_time
        assert t["turns"] == len(t["generation_s"]) == len(t["generated_tokens"]) == len(t["env_s"]) - 1 == 1
        assert all(n >= 1 for n in t["generated_tokens"]) and all(s >= 0 for s in t["env_s"])
        if t["fate"] == "trained":
            low, high = t["token_versions"]
            assert t["version_at_start"] <= low <= high <= t["version_at_train"] == t["step"] - 1
            assert t["reward"] is not None
        else:
            assert t["version_at_train"] is None and t["step"] <= orch.step
    # the step a line names trained that line's group
    by_step = {
        json.loads(x)["step"]: json.loads(x)["groups"]
        for x in (tmp_path / "trained.jsonl").read_text().splitlines()
    }
    assert all(t["group"] in by_step[t["step"]] for t in traces if t["fate"] == "trained")
    # masked episodes are the env's failures (LetterEnv times out every 7th task), never a policy's answer
    assert all(t["outcome"] == "timeout" and t["reward"] is None for t in traces if t["fate"] == "masked")


async def test_traces_switched_off_write_nothing(tmp_path):
    orch, _ = make(tmp_path, steps=2, episode_traces=False)
    await orch.run()
    assert not (tmp_path / EPISODES_FILE).exists()
    assert (tmp_path / "trained.jsonl").exists()


async def test_a_resumed_run_appends_and_each_trained_episode_appears_once(tmp_path):
    orch, _ = make(tmp_path, steps=6)
    orch.on_step = lambda r: orch.request_stop() if r["step"] == 2 else None
    await orch.run()
    before = len(read_episode_traces(tmp_path))
    assert before > 0
    orch2, records = make(tmp_path, steps=6)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    await orch2.resume(ckpt)
    await orch2.run()
    traces = read_episode_traces(tmp_path)
    assert len(traces) > before
    trained = [t for t in traces if t["fate"] == "trained"]
    assert len(trained) == records[-1]["samples/trained_total"]
    per_group = Counter(t["group"] for t in traces if t["group"] in set(orch2.trained_groups))
    assert len(per_group) == 6 * 3 and set(per_group.values()) == {G}
    assert sorted({t["group"] for t in trained}) == sorted(orch2.trained_groups)
    assert {t["step"] for t in trained} == set(range(1, 7))
    # the clock continues across the resume
    assert (
        max(t["start_s"] for t in traces if t["step"] > 2)
        >= max(t["start_s"] for t in traces if t["step"] <= 2) - 1e-9
    )


def _episode(member: int, reward: float | None) -> Trajectory:
    t = Trajectory(
        env_id="e", task_id="t", group_id="g7", tokens_T=[1, 2, 3], loss_mask_T=[0, 1, 1],
        logprobs_T=[0.0, -1.0, -1.0], versions_T=[NO_VERSION, 3, 4], reward=reward,
        outcome="ok" if reward is not None else "env_error", finish_reason="stop", num_turns=1,
        timings={"wall_s": 2.5},
        timeline=EpisodeTimeline(generation_s=(0.5,), generated_tokens=(2,), env_s=(0.25, 1.5)),
    )  # fmt: skip
    trace = finished_record(t, group=7, member=member, version_at_start=3, start_s=10.0)
    return Trajectory(**{**t.__dict__, "info": {TRACE: trace}})


def test_a_kept_group_writes_its_masked_member_at_once_and_the_rest_when_trained(tmp_path):
    group = Group(7, 70, [_episode(0, 1.0), _episode(1, None), _episode(2, 0.0)], start_version=3)
    traces = EpisodeTraces(tmp_path)
    traces.group_finished(group, "kept", steps_done=4)
    (masked,) = read_episode_traces(tmp_path)
    assert (masked["member"], masked["fate"], masked["step"], masked["version_at_train"]) == (
        1,
        "masked",
        4,
        None,
    )
    kept = Group(7, 70, [t for t in group.trajectories if t.reward is not None], start_version=3)
    traces.trained([kept], version_at_train=6, step=7)
    traces.group_finished(group, "zero_variance", steps_done=5)  # a replay after a kill: the last line wins
    traces.close()
    rows = read_episode_traces(tmp_path)
    assert [(r["member"], r["fate"]) for r in rows] == [
        (0, "zero_variance"),
        (1, "zero_variance"),
        (2, "zero_variance"),
    ]
    lines = [json.loads(x) for x in (tmp_path / EPISODES_FILE).read_text().splitlines()]
    assert [(r["member"], r["fate"], r["step"]) for r in lines[:3]] == [
        (1, "masked", 4),
        (0, "trained", 7),
        (2, "trained", 7),
    ]
    first = lines[1]
    assert (first["start_s"], first["end_s"], first["token_versions"], first["version_at_train"]) == (
        10.0,
        12.5,
        [3, 4],
        6,
    )
    assert (first["generation_s"], first["generated_tokens"], first["env_s"]) == ([0.5], [2], [0.25, 1.5])
