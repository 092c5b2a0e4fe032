"""The pieces of backend=ray that need no cluster: placement checks, transcript replay, the lab gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from labrl.envs import Action, Budgets, Env, EnvSpec, Message, Observation, StepResult, Task
from labrl.envs.lab.session import LabSettings, close_connections
from labrl.errors import PlacementError
from labrl.harness.backends.ray.lab_gateway import LabGateway
from labrl.harness.backends.ray.placement import Demand, check_placement
from labrl.harness.backends.ray.transcript_store import discard
from labrl.harness.backends.ray.transcripts import (
    GroupTranscript,
    SavedTurn,
    TranscriptSampler,
    current_group,
)
from labrl.harness.rollout.play import rollout_group
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams

NODES = [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 4.0, "lab_credentials": 1.0}]


def test_a_placement_that_fits_passes():
    check_placement(
        [
            Demand("learner", 1, {"CPU": 1, "GPU": 1}),
            Demand("env worker", 4, {"CPU": 1, "lab_credentials": 0.25}),
        ],
        NODES,
    )


@pytest.mark.parametrize(
    ("demand", "message"),
    [
        (Demand("env worker", 1, {"CPU": 1, "lab": 1}), "env worker: resource lab is on no node"),
        (
            Demand("learner", 1, {"CPU": 1, "GPU": 2}),
            r"learner: one actor needs \{CPU: 1, GPU: 2\} but no node",
        ),
        (Demand("sampler", 1, {"CPU": 1, "GPU": 1, "lab_credentials": 1}), "no node has that much"),
        (Demand("env worker", 7, {"CPU": 1}), r"needs 7 CPU \(env worker 7 x 1\) but the cluster has 6"),
    ],
)
def test_impossible_placements_are_named(demand, message):
    with pytest.raises(PlacementError, match=message):
        check_placement([demand], NODES)


class TwoTurnEnv(Env):
    """Two turns; the second prompt shows the first reply, so a replayed turn must see the same history."""

    def __init__(self) -> None:
        self.spec = EnvSpec(id="test/two-turn-v0", budgets=Budgets(max_turns=2))

    def make_task(self, split, seed: int) -> Task:
        return Task(env_id=self.spec.id, split=split, seed=seed, task_id=f"t{seed}", prompt={})

    async def reset(self, task: Task) -> Observation:
        self.turn = 0
        return Observation(messages=(Message(role="user", content="go"),))

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        done = self.turn == 2
        return StepResult(
            observation=Observation(messages=(Message(role="user", content=f"seen {action.text}"),)),
            reward=1.0 if done else 0.0,
            done=done,
        )


class CountingSampler:
    """Every call answers a different letter: a replayed turn is told apart from a generated one."""

    def __init__(self) -> None:
        self.calls = 0
        self.version = 0

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for r in requests:
            self.calls += 1
            token = ord("a") + self.calls % 26
            out.append(GenerateResult(r.rid, [token], [-0.5], [self.version], "stop"))
        return out


async def _play(group: GroupTranscript, sampler, size: int = 3):
    async def play():
        current_group.set(group)
        return await rollout_group(
            TwoTurnEnv, TwoTurnEnv().make_task("train", 5), sampler, ByteTokenizer(),
            SamplingParams(max_new_tokens=1), size,
        )  # fmt: skip

    return await asyncio.ensure_future(play())


async def test_a_saved_transcript_replays_the_same_actions_without_the_sampler():
    inner = CountingSampler()
    first = GroupTranscript(7)
    played = await _play(first, TranscriptSampler(inner))
    assert inner.calls == 6 and all(len(first.turns[m]) == 2 for m in range(3))
    # members 0 and 2 had a lab job: their records travel; member 1 re-runs
    again = GroupTranscript(7, saved={0: first.turns[0], 2: first.turns[2][:1]})
    replayed = await _play(again, TranscriptSampler(inner))
    assert replayed[0].tokens_T == played[0].tokens_T  # whole episode from the record
    # member 2: its first turn from the record, its second generated; member 1: both generated
    assert (
        replayed[2].tokens_T[:-1] == played[2].tokens_T[:-1]
        and replayed[2].tokens_T[-1] != played[2].tokens_T[-1]
    )
    assert inner.calls == 6 + 1 + 2
    assert again.counters["turns_replayed"] == 3 and not again.diverged
    assert again.resumed(0) and not again.resumed(1)


async def test_a_replay_that_sees_another_prompt_generates_afresh():
    inner = CountingSampler()
    first = GroupTranscript(1)
    await _play(first, TranscriptSampler(inner), size=1)
    wrong = [SavedTurn("0" * 24, first.turns[0][0].result)]
    again = GroupTranscript(1, saved={0: wrong})
    await _play(again, TranscriptSampler(inner), size=1)
    assert again.counters["replay_diverged"] == 1 and again.counters["turns_replayed"] == 0
    assert inner.calls == 4


SYNTHESIS_REQUEST = {
    "kind": "synthesis",
    "recipe": {"precursors": [{"formula": "CaCO3", "mmol": 10}, {"formula": "TiO2", "mmol": 10}],
               "temperature_c": 1200, "time_h": 16, "atmosphere": "air"},
    "sample_seed": 3,
}  # fmt: skip


async def test_the_gateway_keeps_transcripts_and_counts_reattached_jobs():
    gateway = LabGateway()
    settings = LabSettings(None, "LABRL_LAB_API_KEY", None, 0.05)
    request = dict(SYNTHESIS_REQUEST)
    turn = SavedTurn("d", GenerateResult("r", [1], [0.0], [0], "stop"))
    try:
        first = await gateway.run(settings, request, "k1", group=4, member=0, transcript=[turn])
        assert first.status.state.value == "completed" and first.fresh
        assert list((await gateway.saved(4))[0]) == [turn]
        # the worker died; the resumed episode sends the same request and key
        again = await gateway.run(settings, request, "k1", group=4, member=0, transcript=[turn], resumed=True)
        assert (again.status.job_id, again.status.result) == (first.status.job_id, first.status.result)
        assert not again.fresh
        stats = await gateway.stats()
        assert stats["jobs_reattached"] == 1 and stats["mock/jobs"] == 1
        assert stats["mock/max_submits_per_job"] == 1 and stats["mock/max_runs_per_job"] == 1
        await gateway.release([4])
        assert await gateway.saved(4) == {} and (await gateway.stats())["transcripts_held"] == 0
    finally:
        await close_connections()


async def test_transcripts_on_disk_outlive_the_gateway_and_rejoin_its_job(tmp_path):
    """The head node is lost with the gateway in it: a new gateway on the same file (the rerun)
    holds the in-flight episode's transcript and re-attaches its lab job; a fresh run holds nothing."""
    store = tmp_path / "run" / "lab_transcripts.sqlite"
    settings = LabSettings(None, "LABRL_LAB_API_KEY", str(tmp_path / "journal.sqlite"), 0.05)
    request = dict(SYNTHESIS_REQUEST)
    turns = [SavedTurn("d1", GenerateResult("r", [1, 2], [-0.5, -0.25], [0, 1], "stop"))]
    try:
        first = LabGateway(str(store))
        job = await first.run(settings, request, "k1", group=7, member=1, transcript=turns)
        await first.run(settings, request | {"sample_seed": 4}, "k2", group=8, member=0, transcript=turns)
        await first.release([8])  # a checkpoint covers group 8

        rerun = LabGateway(str(store))  # the rerun, or Ray restarting the gateway mid-run
        assert await rerun.held() == [7]
        saved = await rerun.saved(7)
        assert list(saved) == [1] and saved[1] == turns
        again = await rerun.run(settings, request, "k1", group=7, member=1, transcript=saved[1], resumed=True)
        assert again.status.job_id == job.status.job_id and not again.fresh
        assert (await rerun.stats())["jobs_reattached"] == 1

        rerun.store.close()
        discard(store)  # what the driver does before a new (not resumed) run starts its gateway
        assert await LabGateway(str(store)).held() == []
    finally:
        await close_connections()


class _Worker:
    """An env worker handle whose ``play_group`` records whether each group was asked to resume."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.play_group = self

    def remote(self, index, task, sampling, resume):
        from labrl.harness.backends.ray.actors import GroupResult

        self.calls.append((index, resume))
        return _Ref(GroupResult([], {}, 0))


class _Gateway:
    def __init__(self) -> None:
        self.released: list[list[int]] = []
        self.release = self

    def remote(self, groups):
        self.released.append(groups)


async def test_the_pool_resumes_held_groups_and_releases_only_what_a_checkpoint_covers():
    from labrl.harness.backends.ray.clients import EnvWorkerPool

    worker, gateway = _Worker(), _Gateway()
    pool = EnvWorkerPool([worker], gateway, held=[3])
    pool.liveness.close()
    for index in (3, 4, 5):
        await pool.play(index, None, None)
    await pool.play(3, None, None)  # played again later (not from a restart): no resume
    assert worker.calls == [(3, True), (4, False), (5, False), (3, False)]
    assert gateway.released == []  # delivered is not covered: a crash now would replay them
    pool.checkpointed({5})  # the checkpoint still counts group 5 in flight
    assert gateway.released == [[3, 4]]
    pool.checkpointed(set())
    assert gateway.released == [[3, 4], [5]]


class _Ref:
    """Awaitable like a Ray ObjectRef."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        async def get():
            await asyncio.sleep(0.01)
            return self.value

        return get().__await__()


class _SamplerHandle:
    """The ``generate.remote`` of a sampler actor handle, recording each call's batch size."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.generate = self

    def remote(self, requests):
        self.batches.append(len(requests))
        return _Ref([GenerateResult(r.rid, [len(r.input_ids)], [0.0], [0], "stop") for r in requests])


async def test_concurrent_episodes_turns_go_to_the_sampler_actor_in_one_call():
    from labrl.harness.backends.ray.clients import RemoteSampler

    handle = _SamplerHandle()
    remote = RemoteSampler([handle], coalesce_s=0.005)
    requests = [
        GenerateRequest(rid=f"r{i}", input_ids=(1,) * (i + 1), sampling=SamplingParams()) for i in range(10)
    ]
    results = await asyncio.gather(*(remote.generate([r]) for r in requests))
    assert handle.batches == [10]  # one hop for ten episodes' turns
    assert [(res.rid, res.output_ids) for (res,) in results] == [(f"r{i}", [i + 1]) for i in range(10)]
    assert remote.counters["generate_calls"] == 1 and remote.counters["requests"] == 10
