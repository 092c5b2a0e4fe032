"""``synthetic/cascade-v0``: a two-stage cascade with a proxy of controllable bias, noise, cost and latency.

Each task hides a target ``t ~ U(target_low, target_high)`` (default [0.1, 0.9]) and shows a hint
of it; the model answers a number
``x`` in [0, 1] (``<answer>0.42</answer>``). The stages::

    truth  e(x) = max(0, 1 - |x - t| / width)                                  (stage "truth")
    proxy  c(x) = max(0, 1 - |x - (t + proxy_shift)| / width) + proxy_offset + proxy_noise * z   ("proxy")

with ``z ~ N(0, 1)`` drawn from a hash of the task and the answer (the same answer always gets the
same ``z``). ``proxy_offset`` is a constant bias (harmless to a group's advantages);
``proxy_shift`` moves the proxy's optimum away from the truth's (a policy trained on the proxy
alone learns the wrong answer). With the shift at 0 the gap ``c - e`` has mean ``proxy_offset``
and variance ``proxy_noise**2``, the closed form the estimator tests use. The proxy passes a
candidate on to the truth when ``c >= pass_threshold`` (or, with ``top_k``, when it is among the
``top_k`` best of its group by ``c``; with ``informative_z``, when the truth could flip the sign of
its group advantage: ``Informative`` with ``proxy_noise`` as its prior sigma); others are audited with the run's
``cascade.audit_probability``. Costs and latencies (log-normal, ``labrl.envs.cascade.stages.Latency``)
are options; each stage waits its latency with ``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from labrl.envs.cascade.env import CascadeEnv
from labrl.envs.cascade.stages import CostUnit, Informative, Latency, Stage, Threshold, TopK
from labrl.envs.types import Action, Budgets, EnvSpec, Message, Observation, Split, Task
from labrl.errors import ConfigError, InvalidActionError
from labrl.untrusted_text import last_block

ENV_ID = "synthetic/cascade-v0"
_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


class SyntheticCascadeOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    target_low: float = Field(default=0.1, ge=0, le=1, description="targets are drawn from U(low, high)")
    target_high: float = Field(default=0.9, ge=0, le=1, description="see target_low")
    width: float = Field(default=0.25, gt=0, le=1, description="truth falls to 0 this far from the target")
    proxy_shift: float = Field(default=0.0, ge=-1, le=1, description="proxy optimum minus the truth's")
    proxy_offset: float = Field(default=0.0, ge=-10, le=10, description="constant bias of the proxy")
    proxy_noise: float = Field(default=0.1, ge=0, le=10, description="std of the proxy's noise")
    pass_threshold: float = Field(default=0.5, description="proxy value that passes a candidate on")
    top_k: int | None = Field(
        default=None, ge=1, description="pass the top k of the group instead (needs a GroupGate)"
    )
    informative_z: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="pass the members whose group advantage sign the truth could flip, at z (Informative)",
    )
    proxy_cost_cpu_s: float = Field(default=0.01, ge=0)
    truth_cost_gpu_h: float = Field(default=0.001, ge=0)
    proxy_latency_s: float = Field(default=0.001, gt=0, le=3600)
    truth_latency_s: float = Field(default=0.01, gt=0, le=3600)
    latency_sigma: float = Field(default=0.5, ge=0, le=5)
    cascade: dict[str, Any] | None = Field(default=None, description="the run's cascade: section")

    @model_validator(mode="after")
    def _consistent(self) -> SyntheticCascadeOptions:
        if self.top_k is not None and self.informative_z is not None:
            raise ValueError("set top_k or informative_z, not both")
        if self.target_low > self.target_high:
            raise ValueError(f"target_low {self.target_low} is above target_high {self.target_high}")
        return self

    def pass_rule(self) -> Threshold | TopK | Informative:
        """The proxy's rule: ``informative_z``, else ``top_k``, else ``pass_threshold``."""
        if self.informative_z is not None:  # sigma's prior: the proxy's own noise against the truth
            return Informative(noise=self.proxy_noise, z=self.informative_z)
        if self.top_k is not None:
            return TopK(k=self.top_k)
        return Threshold(min_reward=self.pass_threshold)


class SyntheticCascadeEnv(CascadeEnv):
    """See the module docstring."""

    options_model = SyntheticCascadeOptions
    invalid_action_reward: ClassVar[float] = 0.0

    def __init__(self, **options: Any) -> None:
        try:
            self.options = SyntheticCascadeOptions.model_validate(options)
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{ENV_ID}: invalid option(s): {detail}") from None
        super().__init__(self.options.cascade)
        o = self.options
        self.set_stages(
            (
                Stage(
                    name="proxy",
                    cost_unit=CostUnit.CPU_S,
                    cost=o.proxy_cost_cpu_s,
                    latency=Latency(median_s=o.proxy_latency_s, sigma=o.latency_sigma),
                    pass_on=o.pass_rule(),
                ),
                Stage(
                    name="truth",
                    cost_unit=CostUnit.GPU_H,
                    cost=o.truth_cost_gpu_h,
                    latency=Latency(median_s=o.truth_latency_s, sigma=o.latency_sigma),
                ),
            ),
            ENV_ID,
        )
        # a stage's deadline: a minute beyond its latency at 4 sigma (a draw past it: 1 in 30,000)
        tails = [round(60 + s.latency.median_s * math.exp(4 * s.latency.sigma), 1) for s in self.stages]
        self.spec = EnvSpec(
            id=ENV_ID,
            description="Name a hidden number; scored by a cheap biased proxy, audited by the truth.",
            budgets=Budgets(
                max_turns=1, reset_timeout_s=10, scoring_timeout_s=max(tails), step_timeout_s=sum(tails)
            ),
            tags=("synthetic", "cascade"),
            has_gold_answer=True,
        )

    def make_task(self, split: Split, seed: int) -> Task:
        # train and test targets come from different streams, so no task is in both; one draw
        # (low + (high - low) * u) so a band's targets are the default's mapped onto it
        o = self.options
        target = random.Random(f"{ENV_ID}/{split}/{seed}").uniform(o.target_low, o.target_high)
        return Task(
            env_id=ENV_ID,
            split=split,
            seed=seed,
            task_id=f"{split}-{seed}",
            prompt={"hint": round(target, 2)},
            answer=target,
        )

    async def reset(self, task: Task) -> Observation:
        self._task = task
        text = (
            f"A hidden number between 0 and 1 is close to {task.prompt['hint']}. Name it as precisely "
            "as you can, inside <answer></answer>, e.g. <answer>0.5</answer>."
        )
        return Observation(messages=(Message(role="user", content=text),))

    def candidate(self, action: Action) -> float:
        body = last_block(action.text, "<answer>", "</answer>")
        if body is None:
            raise InvalidActionError("no <answer>...</answer> block found")
        match = _NUMBER.match(body)
        if not match:
            raise InvalidActionError(f"the answer must be one number, got {body.strip()[:60]!r}")
        x = float(match.group(1))
        if not 0.0 <= x <= 1.0:
            raise InvalidActionError(f"the answer must lie in [0, 1], got {x:g}")
        return x

    def candidate_text(self, candidate: float) -> str:
        return repr(candidate)

    def baseline_inputs(self, candidate: float, first_value: float) -> tuple[float, ...]:
        # the answer's offset from the hint: the truth is a function of it up to the hint's rounding;
        # the proxy's value adds only its noise (measured: residual sd 0.05 with it, 0.02 without)
        return (candidate - float(self.episode_task().prompt["hint"]),)

    async def evaluate(self, stage: Stage, candidate: float) -> float:
        task = self.episode_task()
        rng = random.Random(hashlib.sha256(f"{task.task_id}/{stage.name}/{candidate!r}".encode()).digest())
        await asyncio.sleep(stage.latency.sample(rng))
        o = self.options
        if stage.name == "truth":
            return peak(candidate, float(task.answer), o.width)
        return (
            peak(candidate, float(task.answer) + o.proxy_shift, o.width)
            + o.proxy_offset
            + o.proxy_noise * rng.gauss(0.0, 1.0)
        )

    def gold_actions(self, task: Task) -> Sequence[Action] | None:
        return [Action(text=f"<answer>{float(task.answer)!r}</answer>")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        return Action(text=f"<answer>{rng.random():.3f}</answer>")


def peak(x: float, centre: float, width: float) -> float:
    """``max(0, 1 - |x - centre| / width)``: 1 at the centre, 0 from ``width`` away."""
    return max(0.0, 1.0 - abs(x - centre) / width)
