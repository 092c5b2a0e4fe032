"""Evaluation on the env's test split: ``eval_size`` episodes with the sampler's current weights.

One record per evaluation (``eval.jsonl``, the summary's ``eval_history``)::

    accuracy      = #(reward >= 1 - 1e-9) / n          (unscored episodes count as wrong)
    reward_mean   = mean reward over the n_scored episodes with a reward (None if none)
    overlong_frac = #(finish_reason == "length") / n
    errors/*      = failure rates by outcome (``stats.failure_rates``)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from labrl.envs.base import Env
from labrl.harness.pipeline.errors_log import ErrorLog
from labrl.harness.pipeline.stats import failure_rates
from labrl.harness.rollout.play import rollout
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import Sampler, SamplingParams, Trajectory


@dataclass
class EvalOnTestSplit:
    """Plays test tasks ``0 .. size-1`` at most ``concurrency`` at a time, one fresh env each.

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
                try:
                    task = env.make_task("test", i)
                    return await rollout(
                        env, task, sampler, self.tokenizer, self.sampling, rid_prefix=f"eval{step}:"
                    )
                finally:
                    await env.close()

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(self.size)))
        if self.errors is not None:
            self.errors.episodes(results, step=step, phase="eval")
        outcomes = Counter(t.outcome for t in results)
        scored = [t.reward for t in results if t.reward is not None]
        return {
            "step": step,
            "sampler_version": version,
            "n": len(results),
            "n_scored": len(scored),
            "accuracy": sum(1 for r in scored if r >= 1.0 - 1e-9) / len(results),
            "reward_mean": sum(scored) / len(scored) if scored else None,
            "overlong_frac": sum(t.finish_reason == "length" for t in results) / len(results),
            "eval_s": time.perf_counter() - t0,
            "time_s": time_s(),
            **{f"errors/{k}": v for k, v in failure_rates(outcomes, len(results)).items()},
        }
