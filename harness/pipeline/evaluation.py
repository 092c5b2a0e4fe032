"""Evaluation on the env's test split: ``eval_size`` episodes with the sampler's current weights.

One record per evaluation (``eval.jsonl``, the summary's ``eval_history``)::

    accuracy      = #(reward >= 1 - 1e-9) / n          (unscored episodes count as wrong)
    reward_mean   = mean reward over the n_scored episodes with a reward (None if none)
    overlong_frac = #(finish_reason == "length") / n
    errors/*      = failure rates by outcome (``stats.failure_rates``)
    by_label      = {task label: {"n", "accuracy", "answers": {answer label: count}}}
                    only where the env labels its tasks (``Env.task_label``): accuracy as above
                    within the label; answers the TOP_ANSWERS most frequent, the rest summed as
                    OTHER_ANSWERS; a failed episode is answered "(<outcome>)"
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from labrl.envs.base import Env
from labrl.envs.cascade import GroupGate
from labrl.harness.pipeline.errors_log import ErrorLog
from labrl.harness.pipeline.stats import failure_rates
from labrl.harness.rollout.play import join_cascade_group, nth_draw, rollout
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import Sampler, SamplingParams, Trajectory

#: answers listed per task label in ``by_label``; the rarer ones are summed under ``OTHER_ANSWERS``
TOP_ANSWERS = 5
OTHER_ANSWERS = "(other)"


def solved(t: Trajectory) -> bool:
    """Whether the episode counts as correct: full reward (an unscored episode never does)."""
    return t.reward is not None and t.reward >= 1.0 - 1e-9


def accuracy_by_label(results: list[Trajectory]) -> dict[str, dict[str, Any]] | None:
    """The ``by_label`` breakdown (module docstring); None when no episode carries a task label."""
    groups: dict[str, list[Trajectory]] = {}
    for t in results:
        if "task_label" in t.info:
            groups.setdefault(t.info["task_label"], []).append(t)
    if not groups:
        return None
    out = {}
    for label in sorted(groups):
        members = groups[label]
        answers = Counter(t.info["answer_label"] for t in members if "answer_label" in t.info)
        top = dict(answers.most_common(TOP_ANSWERS))
        rest = answers.total() - sum(top.values())
        out[label] = {
            "n": len(members),
            "accuracy": sum(solved(t) for t in members) / len(members),
            "answers": {**top, **({OTHER_ANSWERS: rest} if rest else {})},
        }
    return out


@dataclass
class EvalOnTestSplit:
    """Plays test tasks ``0 .. size-1`` at most ``concurrency`` at a time, one fresh env each;
    seeded sampling draws task ``i`` with seed ``seed + i`` (``nth_draw``).

    A cascade env whose rule decides by the group plays each held-out episode as a group of one
    (``TopK`` passes it on; ``Informative`` sees no advantage to flip and only audits).

    ``sampling``: the evaluation's own (its temperature and seed), not the training one.
    """

    make_env: Callable[[], Env]
    tokenizer: Tokenizer
    sampling: SamplingParams
    _: KW_ONLY
    size: int
    concurrency: int
    errors: ErrorLog | None = None

    async def run(self, sampler: Sampler, step: int, *, time_s: Callable[[], float]) -> dict[str, Any]:
        """The record of the evaluation at ``step``; ``time_s`` reads the run's clock when it ends."""
        version = sampler.version
        slots = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> Trajectory:
            async with slots:
                env = self.make_env()
                join_cascade_group(env, GroupGate(1), 0)  # a held-out episode is a group of its own
                try:
                    task = env.make_task("test", i)
                    # each task its own draws: one seed for all would give every task the same noise
                    sampling = nth_draw(self.sampling, i)
                    return await rollout(
                        env, task, sampler, self.tokenizer, sampling, rid_prefix=f"eval{step}:"
                    )
                finally:
                    await env.close()

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(self.size)))
        if self.errors is not None:
            self.errors.episodes(results, step=step, phase="eval")
        outcomes = Counter(t.outcome for t in results)
        scored = [t.reward for t in results if t.reward is not None]
        by_label = accuracy_by_label(results)
        return {
            "step": step,
            "sampler_version": version,
            "n": len(results),
            "n_scored": len(scored),
            "accuracy": sum(solved(t) for t in results) / len(results),
            "reward_mean": sum(scored) / len(scored) if scored else None,
            "overlong_frac": sum(t.finish_reason == "length" for t in results) / len(results),
            "eval_s": time.perf_counter() - t0,
            "time_s": time_s(),
            **{f"errors/{k}": v for k, v in failure_rates(outcomes, len(results)).items()},
            **({"by_label": by_label} if by_label is not None else {}),
        }
