"""Typed config of the megatron-core learner."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.harness.identity import IDENTITY
from labrl.harness.learners.proximal import ProximalForwardChoice
from labrl.harness.models.config import MoEModelConfig, ParallelConfig, get_preset
from labrl.harness.models.device import DEVICE_PATTERN, ExpertsRequest, ObjectiveKernel, PrecisionChoice
from labrl.harness.objectives import ObjectiveConfig

ReferenceKind = Literal["none", "initial"]


def check_reference(reference: str, kl_coef: float, *, prefix: str) -> None:
    """``kl_coef > 0`` needs a reference policy, and a reference is only computed for the KL term.

    ``prefix`` is ``"learner."`` in a run config, where the two fields live in different sections.
    """
    ref = f"{prefix}reference"
    if kl_coef > 0 and reference == "none":
        raise ValueError(
            f"objective.kl_coef={kl_coef} needs a reference policy: set {ref}=initial "
            f"(the weights frozen when RL starts), or objective.kl_coef=0"
        )
    if kl_coef == 0 and reference != "none":
        raise ValueError(
            f"{ref}={reference} is only used by the reference-KL term, which objective.kl_coef=0 turns off: "
            f"set objective.kl_coef > 0, or {ref}=none"
        )


def lr_factor(
    step: int, *, schedule: str, warmup_steps: int, total_steps: int | None, min_lr_ratio: float
) -> float:
    """The multiplier of the base lr at optimizer step ``step`` (0-based); see ``OptimizerConfig``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError("the cosine schedule needs total_steps")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class OptimizerConfig(BaseModel):
    """AdamW with linear warmup then a constant or cosine learning rate.

    lr(step) = lr * min(1, (step + 1) / (warmup_steps + 1)) during warmup; after
    it, cosine decays to ``lr * min_lr_ratio`` at ``total_steps``:
    lr * (r + (1 - r) * (1 + cos(pi * progress)) / 2).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float | None = Field(default=1.0, gt=0, description="max global grad norm; None disables")
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = Field(default=None, ge=1, description="needed by the cosine schedule")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)

    @model_validator(mode="after")
    def _cosine_needs_total(self) -> OptimizerConfig:
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps: set optimizer.total_steps")
        return self

    def lr_factor(self, step: int) -> float:
        return lr_factor(
            step,
            schedule=self.schedule,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )


class LearnerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: MoEModelConfig = Field(default_factory=lambda: get_preset("tiny-moe"))
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    micro_batch_size: int = Field(default=16, ge=1, description="sequences per forward/backward")
    length_sorted_micro_batches: bool = Field(
        default=False,
        description="sort rows by length and cut each micro-batch to its longest row "
        "(less padding on ragged batches; labrl.harness.rollout.batching.micro_batches)",
    )
    minibatches: int = Field(
        default=1,
        ge=1,
        description="optimizer steps per pass over a batch: its rows are split into this many parts "
        "(1 = one step on the whole batch, the default)",
    )
    epochs: int = Field(
        default=1,
        ge=1,
        description="passes over each batch; epochs * minibatches optimizer steps per batch, "
        "all publishing one policy version (1 = the default)",
    )
    proximal_forward: ProximalForwardChoice = Field(
        default="auto",
        description="auto: with one optimizer step per batch, take the proximal log-probs from the loss forward "
        "(under a whole-batch term such as M2PO with several micro-batches: every loss forward first, its graph "
        "kept within learner.graph_memory_fraction) | separate: always a no-grad forward first",
    )
    graph_memory_fraction: float = Field(
        default=0.5,
        ge=0,
        lt=1,
        description="under a whole-batch term (M2PO) with several micro-batches: the share of the device's "
        "free memory the kept loss-forward graphs (and the step's gradients) may use, so that no separate "
        "no-grad forward is needed; micro-batches past it get one (labrl.harness.learners.graph_memory). "
        "0: the separate forward for every micro-batch",
    )
    max_consecutive_skips: int = Field(
        default=5,
        ge=1,
        description="optimizer steps skipped in a row on non-finite log-probs, loss or grad norm "
        "before train_step raises LearnerError",
    )
    router_replay: bool = Field(
        default=True, description="replay the sampler's routed experts when the batch has them"
    )
    temperature: float = Field(
        default=1.0, gt=0, description="logits / temperature, as the sampler's log-probs"
    )
    reference: ReferenceKind = Field(
        default="none",
        description="reference policy for objective.kl_coef > 0: 'initial' freezes the weights at the first train_step",
        json_schema_extra=IDENTITY,  # whether a checkpoint holds a frozen reference policy
    )
    seed: int = 0
    device: str = Field(
        default="auto", pattern=DEVICE_PATTERN, description="auto (CUDA when available) | cpu | cuda[:N]"
    )
    precision: PrecisionChoice = Field(
        default="auto",
        description="parameters and compute: auto (bf16 on CUDA for models of 100M parameters or more, else fp32) | fp32 | bf16; "
        "the optimizer keeps fp32 master weights under bf16, log-probs and loss are fp32",
    )
    experts: ExpertsRequest = Field(
        default="auto",
        description="MoE experts module of the local spec: auto (all experts in one torch grouped_mm on CUDA "
        "in bf16, one after another elsewhere) | sequential | grouped_mm; same weights and checkpoint names",
    )

    objective_kernel: ObjectiveKernel = Field(
        default="eager",
        description="the per-micro-batch objective: eager (op by op) | compiled (torch.compile: a few fused "
        "kernels, equal to round-off; needs Triton on CUDA; not the default until a GPU measures it faster)",
    )

    @model_validator(mode="after")
    def _reference_matches_kl(self) -> LearnerConfig:
        check_reference(self.reference, self.objective.kl_coef, prefix="")
        return self

    @model_validator(mode="before")
    @classmethod
    def _preset_name(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            data = {**data, "model": get_preset(data["model"])}
        return data
