"""Shared by the cascade tests: samplers that answer, one group of the synthetic cascade, an orchestrator over it."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from pathlib import Path

from pipeline_fakes import BigramLearner, BigramSampler

from labrl.cli import main
from labrl.envs import Action, make
from labrl.envs.types import Task
from labrl.harness.pipeline import Orchestrator
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.rollout.play import rollout_group
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams, Trajectory

FAST = {"proxy_latency_s": 1e-4, "truth_latency_s": 1e-4}
TOKENIZER = ByteTokenizer()


class MemberSampler:
    """Replies ``replies[i]`` to group member ``i`` (its request ids start ``g{i}:``); None aborts the turn."""

    version = 0

    def __init__(self, replies: Sequence[str | None]) -> None:
        self.replies = replies

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for r in requests:
            reply = self.replies[int(r.rid.split(":", 1)[0][1:])]
            if reply is None:  # the prompt left no room: the episode ends before the env is stepped
                out.append(GenerateResult(r.rid, [], [], [], "abort"))
                continue
            ids = TOKENIZER.encode(reply)
            out.append(GenerateResult(r.rid, ids, [0.0] * len(ids), [0] * len(ids), "stop"))
        return out


async def play_group(replies: Sequence[str | None], **options) -> tuple[Task, list[Trajectory]]:
    """Play one group of the synthetic cascade (top-1 unless ``options`` say otherwise), one reply per member."""
    options = {**FAST, "top_k": 1, "proxy_noise": 0.0, "cascade": {"audit_probability": 1e-4}, **options}

    def make_env():
        return make("synthetic/cascade-v0", **options)

    task = make_env().make_task("train", 0)
    play = rollout_group(
        make_env, task, MemberSampler(replies), TOKENIZER, SamplingParams(max_new_tokens=32), len(replies)
    )
    return task, await asyncio.wait_for(play, timeout=20)  # a member left waiting would hang: fail instead


class AnswerSampler(BigramSampler):
    """Answers every request ``<answer>x</answer>`` with ``x`` uniform in [0, 1), drawn from the request's
    seed and id (so a group's members differ), versioned and updated as ``BigramSampler``."""

    async def _one(self, r: GenerateRequest) -> GenerateResult:
        x = random.Random(f"{r.sampling.seed}/{r.rid}").random()
        ids = [*TOKENIZER.encode(f"<answer>{x:.3f}</answer>"), TOKENIZER.stop_token_ids[0]]
        return GenerateResult(r.rid, ids, [-1.0] * len(ids), [self.version] * len(ids), "stop")


def cascade_orchestrator(
    run_dir: Path, *, steps: int = 2, eval_every: int | None = None, **options
) -> tuple[Orchestrator, list[dict], list[dict]]:
    """An orchestrator over the synthetic cascade (``options``) with a sampler that always answers; its step
    and evaluation records. It evaluates at the start and the end unless ``eval_every`` says otherwise."""
    cfg = PipelineSection(
        mode="pipeline", batch_groups=2, group_size=4, total_steps=steps, eval_every=steps if eval_every is None else eval_every, eval_size=4, progress=False,
        max_staleness=1, dynamic_sampling=False,
    )  # fmt: skip
    records: list[dict] = []
    evals: list[dict] = []
    orch = Orchestrator(
        cfg,
        make_env=lambda: make("synthetic/cascade-v0", **{**FAST, **options}),
        sampler=AnswerSampler(),
        learner=BigramLearner(),
        tokenizer=TOKENIZER,
        sampling=SamplingParams(max_new_tokens=24),
        run_dir=run_dir,
        on_step=records.append,
        on_eval=evals.append,
    )
    return orch, records, evals


#: shrinks a shipped cascade config to two tiny steps for an end-to-end ``labrl train`` test
SHRINK = [
    "sft.steps=2", "sft.batch_size=2", "sft.num_prompts=2", "pipeline.total_steps=2",
    "pipeline.eval_every=2", "pipeline.eval_size=2", "pipeline.batch_groups=1", "pipeline.group_size=2",
    "pipeline.progress=false",
]  # fmt: skip


def assert_trains_two_steps(config: Path, run_dir: Path, extra: list[str], capsys) -> None:
    """``labrl train config`` (shrunk) exits 0 after steps 1 and 2 with no env or verifier failure."""
    assert main(["train", str(config), *SHRINK, f"run_dir={run_dir}", *extra]) == 0, capsys.readouterr()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["errors/env_error_total"] == rows[-1]["errors/verifier_failed_total"] == 0


async def play_one_step(env, task, text: str):
    """Reset ``env`` on ``task``, step it with ``text`` and close it: the step's result."""
    try:
        await env.reset(task)
        return await env.step(Action(text=text))
    finally:
        await env.close()
