"""Records and protocols shared by samplers, rollout, buffer and learners.

Token-level data travels as plain Python lists / numpy arrays in the records
(cheap to pickle across processes and Ray) and becomes padded torch tensors
only in ``TrainBatch``.

Shape suffixes: ``_T`` per token, ``_B_T`` batch x token,
``_T_L_K`` token x MoE layer x top-k expert index.

Version bookkeeping (what deep-staleness control needs):
- a sampler tags every generated token with the policy version that produced
  it (``versions_T``); a weight update that lands mid-generation makes later
  tokens carry the new version;
- tokens the model did not generate (prompt, tool output) carry version -1
  and loss mask 0;
- staleness of a token at training time = learner version - token version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "abort"]

NO_VERSION = -1  # version tag of tokens the policy did not generate


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 disables top-k")
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    return_routed_experts: bool = False


@dataclass(frozen=True)
class GenerateResult:
    """One finished generation.

    ``routed_experts_T_L_K`` covers prompt and output tokens
    (``len(input_ids) + len(output_ids)`` rows, int32, one slice per MoE
    layer): the expert indices the sampler routed each token to, in the
    layout the learner replays. None when not requested.
    """

    rid: str
    output_ids: list[int]
    logprobs_T: list[float]  # behaviour log-prob of each output token
    versions_T: list[int]  # policy version that produced each output token
    finish_reason: FinishReason
    routed_experts_T_L_K: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.logprobs_T) != n or len(self.versions_T) != n:
            raise ValueError(
                f"GenerateResult {self.rid}: {n} output ids but {len(self.logprobs_T)} logprobs "
                f"and {len(self.versions_T)} versions"
            )


@runtime_checkable
class Sampler(Protocol):
    """An inference engine the harness samples from (LocalSampler, SGLangSampler)."""

    @property
    def version(self) -> int: ...

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]: ...

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *, force: bool = False
    ) -> None:
        """Load ``weights`` as policy ``version``; tokens generated from the next step on carry it.

        Versions normally increase; ``force=True`` re-asserts a version the
        sampler may already be past (the start or resume of a run, where the
        learner's checkpoint is the source of truth).
        """
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...


@runtime_checkable
class ReportsSamplerStats(Protocol):
    """A sampler that counts its work (optional ability; checked with ``isinstance``).

    ``stats["busy_s"]``: wall seconds with at least one request in flight (the
    pipeline's "sampler busy" fraction); other keys are the sampler's own
    counters (``generated_tokens``, ``retried``, ...).
    """

    @property
    def stats(self) -> Mapping[str, float]: ...


@runtime_checkable
class Closeable(Protocol):
    """A sampler holding resources (HTTP clients, process groups) that the run releases at its end."""

    async def close(self) -> None: ...


class SamplerWrapper:
    """Base of samplers that change ``generate`` and pass everything else to ``inner``.

    Weight updates, pause/resume, the version, stats and close go straight
    through, so a wrapper only writes the behaviour it adds.
    """

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def stats(self) -> Mapping[str, float]:
        return self.inner.stats if isinstance(self.inner, ReportsSamplerStats) else {}

    async def close(self) -> None:
        if isinstance(self.inner, Closeable):
            await self.inner.close()

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *, force: bool = False
    ) -> None:
        await self.inner.update_weights(weights, version, force=force)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()


@dataclass(frozen=True)
class EpisodeTimeline:
    """Where one episode's time went, call by call (``RUN_DIR/episodes.jsonl``, docs/planning.md).

    ``generation_s[i]`` and ``generated_tokens[i]`` are policy turn ``i``'s sampler call;
    ``env_s`` holds the env calls in order: ``reset`` first, then one ``step`` per turn, so
    ``len(env_s) == len(generation_s) + 1`` unless the episode ended inside a turn.
    """

    generation_s: tuple[float, ...] = ()
    generated_tokens: tuple[int, ...] = ()
    env_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Trajectory:
    """One episode as token-level training data.

    All ``_T`` lists have the same length (the whole conversation, prompt
    included). ``loss_mask_T`` is 1 exactly on tokens the model generated.
    ``reward`` is None when the episode's outcome is not trainable
    (timeout, env_error, verifier_failed): such trajectories are counted and
    masked, never trained on as if they scored 0.
    """

    env_id: str
    task_id: str
    group_id: str
    tokens_T: list[int]
    loss_mask_T: list[int]
    logprobs_T: list[float]  # behaviour log-probs; 0.0 where loss_mask is 0
    versions_T: list[int]  # NO_VERSION where loss_mask is 0
    reward: float | None
    outcome: str  # labrl.envs.Outcome value
    finish_reason: FinishReason
    num_turns: int
    routed_experts_T_L_K: np.ndarray | None = None
    timings: dict[str, float] = field(default_factory=dict)  # generation_s, env_s, queue_s, ...
    info: dict[str, Any] = field(default_factory=dict)
    # a class-level None default, so trajectories pickled before the field existed read None
    timeline: EpisodeTimeline | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens_T)
        lengths = {len(self.loss_mask_T), len(self.logprobs_T), len(self.versions_T)}
        if lengths != {n}:
            raise ValueError(
                f"Trajectory {self.task_id}: per-token lists differ in length ({n}, {sorted(lengths)})"
            )
        if self.routed_experts_T_L_K is not None and self.routed_experts_T_L_K.shape[0] != n:
            raise ValueError(
                f"Trajectory {self.task_id}: routed experts cover {self.routed_experts_T_L_K.shape[0]} tokens, expected {n}"
            )

    @property
    def num_model_tokens(self) -> int:
        return int(sum(self.loss_mask_T))


@dataclass
class TrainBatch:
    """Padded tensors for one learner step (B sequences, T tokens).

    ``advantages_B`` are filled by the objective from ``rewards_B`` and
    ``group_ids_B``. ``attention_mask_B_T`` is 1 on real tokens, 0 on padding.
    """

    tokens_B_T: torch.Tensor  # long
    attention_mask_B_T: torch.Tensor  # bool
    loss_mask_B_T: torch.Tensor  # bool: model-generated tokens
    behaviour_logprobs_B_T: torch.Tensor  # float32
    versions_B_T: torch.Tensor  # long, NO_VERSION off the loss mask
    rewards_B: torch.Tensor  # float32
    group_ids_B: torch.Tensor  # long: trajectories of one task share an id
    routed_experts_B_T_L_K: torch.Tensor | None = None  # long

    @property
    def batch_size(self) -> int:
        return int(self.tokens_B_T.shape[0])


@runtime_checkable
class Learner(Protocol):
    @property
    def version(self) -> int: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...

    def export_weights(self) -> dict[str, torch.Tensor]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...
