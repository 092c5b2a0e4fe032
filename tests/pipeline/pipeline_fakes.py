"""Small honest implementations of the Sampler and Learner protocols, and a fixture env.

The policy is a bigram table ``W[prev_token] -> logits`` over the byte
tokenizer's vocabulary: the sampler samples from it token by token (awaiting
between tokens so weight updates land mid-generation, tagging each token with
the version that produced it); the learner trains the same table with the
real objective (``labrl.harness.objectives``) and AdamW.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from labrl_test_envs import seeded_task

from labrl.envs import Action, Env, EnvSpec, Message, Observation, StepResult, Task
from labrl.errors import SamplerError
from labrl.harness import objectives
from labrl.harness.objectives import ObjectiveConfig
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, GenerateResult, TrainBatch

V = ByteTokenizer().vocab_size
GOOD = "abcdefghijklm"


def initial_table() -> torch.Tensor:
    """Letters a-z favoured (logit +3) so rewards vary within a group from the start."""
    w = torch.zeros(V, V)
    w[:, ord("a") : ord("z") + 1] = 3.0
    return w


class BigramSampler:
    def __init__(
        self, weights: torch.Tensor | None = None, *, decode_delay: float = 0.0, version: int = 0
    ) -> None:
        self.W = (weights if weights is not None else initial_table()).clone()
        self._version = version
        self.decode_delay = decode_delay
        self.updates: list[int] = []  # versions loaded, in order
        self.stats = {"busy_s": 0.0, "generated_tokens": 0}
        self.mid_generation_updates = 0
        self._active = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, r: GenerateRequest) -> GenerateResult:
        gen = torch.Generator().manual_seed(r.sampling.seed if r.sampling.seed is not None else 0)
        prev = r.input_ids[-1]
        out, lps, vers = [], [], []
        finish = "length"
        self._active += 1
        try:
            for _ in range(r.sampling.max_new_tokens):
                temp = r.sampling.temperature
                logits = self.W[prev]
                logp = torch.log_softmax(logits / (temp if temp > 0 else 1.0), dim=-1)
                if temp == 0:
                    tok = int(torch.argmax(logits))
                else:
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(tok)
                lps.append(float(logp[tok]))
                vers.append(self._version)
                prev = tok
                if tok in r.sampling.stop_token_ids:
                    finish = "stop"
                    break
                await asyncio.sleep(self.decode_delay)
        finally:
            self._active -= 1
        self.stats["generated_tokens"] += len(out)
        return GenerateResult(
            rid=r.rid, output_ids=out, logprobs_T=lps, versions_T=vers, finish_reason=finish
        )

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *, force: bool = False
    ) -> None:
        if self._active:
            self.mid_generation_updates += 1
        if version <= self._version and self.updates and not force:
            raise SamplerError(f"weight version must increase: {version} <= {self._version}")
        self.W = weights["W"].clone()
        self._version = version
        self.updates.append(version)

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None


class BigramLearner:
    def __init__(
        self, objective: ObjectiveConfig | None = None, *, lr: float = 0.05, train_delay: float = 0.0
    ) -> None:
        self.W = torch.nn.Parameter(initial_table())
        self.objective = objective or ObjectiveConfig(loss="reinforce", corrections=[])
        self.opt = torch.optim.Adam([self.W], lr=lr)
        self._version = 0
        self.train_delay = train_delay
        self.batches: list[TrainBatch] = []
        self.versions_at_train: list[int] = []

    @property
    def version(self) -> int:
        return self._version

    def _logprobs(self, tokens_B_T: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(self.W[tokens_B_T[:, :-1]], dim=-1)  # (B, T-1, V)
        lp = logp.gather(-1, tokens_B_T[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # (B, T)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        if self.train_delay:
            time.sleep(self.train_delay)
        self.batches.append(batch)
        self.versions_at_train.append(self._version)
        with torch.no_grad():
            old = self._logprobs(batch.tokens_B_T)
        prepared = objectives.prepare(
            self.objective, objectives.ObjectiveInputs.from_train_batch(batch, old, self._version)
        )
        self.opt.zero_grad()
        loss, metrics = objectives.policy_loss(self.objective, self._logprobs(batch.tokens_B_T), prepared)
        loss.backward()
        self.opt.step()
        self._version += 1
        return objectives.combine_metrics(prepared, [metrics]) | {"learner/version": float(self._version)}

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {"W": self.W.detach().clone()}

    def save_checkpoint(self, path: str) -> None:
        torch.save({"W": self.W.detach(), "opt": self.opt.state_dict(), "version": self._version}, path)

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(path, weights_only=False)
        with torch.no_grad():
            self.W.copy_(state["W"])
        self.opt.load_state_dict(state["opt"])
        self._version = state["version"]


class LetterEnv(Env):
    """Single turn: reward 1 if the reply starts with a letter in a-m, else 0.

    Step latency is lognormal per task (deterministic in the seed): median
    ``latency_s``, sigma ``sigma``. ``fail_every`` > 0 makes every n-th task
    time out (outcome ``timeout``) so masking can be tested; ``error_every`` /
    ``verifier_fail_every`` > 0 make every n-th task's step raise ``EnvError``
    (outcome ``env_error``) / ``VerifierError`` (``verifier_failed``).
    """

    def __init__(
        self,
        latency_s: float = 0.0,
        sigma: float = 0.0,
        fail_every: int = 0,
        error_every: int = 0,
        verifier_fail_every: int = 0,
    ) -> None:
        self.spec = EnvSpec(id="test/letter-v0", has_gold_answer=True)
        self.latency_s = latency_s
        self.sigma = sigma
        self.fail_every = fail_every
        self.error_every = error_every
        self.verifier_fail_every = verifier_fail_every
        self.task: Task | None = None

    def make_task(self, split: Any, seed: int) -> Task:
        rng = random.Random(f"{split}:{seed}")
        delay = self.latency_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.latency_s else 0.0
        return seeded_task(self, "letter", split, seed, prompt={"delay": delay})

    async def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(messages=(Message(role="user", content="x"),))

    async def step(self, action: Action) -> StepResult:
        assert self.task is not None
        if self.task.prompt["delay"]:
            await asyncio.sleep(self.task.prompt["delay"])
        if self.fail_every and self.task.seed % self.fail_every == 0:
            from labrl.envs.types import Outcome

            return StepResult(reward=None, done=True, outcome=Outcome.TIMEOUT)
        if self.error_every and self.task.seed % self.error_every == 0:
            from labrl.errors import EnvError

            raise EnvError(f"letter backend down for task {self.task.task_id}")
        if self.verifier_fail_every and self.task.seed % self.verifier_fail_every == 1:
            from labrl.errors import VerifierError

            raise VerifierError(f"letter verifier broke on task {self.task.task_id}")
        text = action.text
        return StepResult(reward=float(bool(text) and text[0] in GOOD), done=True)

    def gold_actions(self, task: Task) -> list[Action]:
        return [Action(text="a")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        return Action(text=rng.choice("abcdefghijklmnopqrstuvwxyz"))
