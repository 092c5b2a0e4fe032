"""A short supervised warm start that teaches the answer *format* only.

Targets are the env's ``random_action`` for each prompt: on-format but
uninformed (for ``xrd/phase-id-v0`` tier 1, a uniformly random candidate
letter). The gold answer is never read, so after the warm start the policy
answers in the right format at chance accuracy, and everything above chance
comes from RL. Loss = mean cross-entropy over the target tokens (the reply and
its end-of-turn token); the prompt is context only.

It runs directly on the learner's model with its own AdamW (the RL optimizer
state starts clean) and does not advance the learner's version. The model's
precision decides the optimizer as it does the learner's
(``labrl.harness.learners.precision.adamw_with_precision``): bf16 parameters
are stepped through fp32 master weights, so small updates are not rounded away;
the learner re-takes its own master weights from the model at its first step.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.envs.base import Env
from labrl.harness.learners.config import lr_factor
from labrl.harness.learners.precision import adamw_with_precision
from labrl.harness.models import device as dev
from labrl.harness.models.build import CausalInputs
from labrl.harness.tokenizer import Tokenizer

SFT_SEED_OFFSET = 7_000_000_000  # SFT prompts come from train seeds far from the RL schedule's


class SFTSection(BaseModel):
    """Format-only supervised warm start: targets are the env's *random* on-format actions, never gold."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    steps: int = Field(default=100, ge=1)
    batch_size: int = Field(default=16, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="linear warmup to lr over the first steps (the learner's lr_factor): Adam's first "
        "updates are about lr per weight whatever the gradient, which a wide model's logits may not survive",
    )
    schedule: Literal["constant", "cosine"] = Field(
        default="constant",
        description="cosine: the lr decays to lr * min_lr_ratio at the last step, so the format is learned "
        "to a lower loss than the noise of a constant lr allows",
    )
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="the cosine schedule's floor, as a fraction of lr"
    )
    num_prompts: int = Field(default=256, ge=1, description="distinct train prompts to cycle through")

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> SFTSection:
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"sft.warmup_steps={self.warmup_steps} >= sft.steps={self.steps}: the lr would never reach "
                "sft.lr; use fewer warmup steps"
            )
        return self


async def sft_prompts(
    make_env: Callable[[], Env], tokenizer: Tokenizer, n: int, seed: int
) -> list[tuple[Any, list[int]]]:
    """``n`` (task, prompt tokens) pairs from the train split."""
    env = make_env()
    out = []
    try:
        for i in range(n):
            task = env.make_task("train", SFT_SEED_OFFSET + seed * 100_003 + i)
            obs = await env.reset(task)
            out.append((task, tokenizer.chat_prompt(obs.messages, obs.tools or env.spec.tools)))
    finally:
        await env.close()
    return out


def _batch(rows: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens (B, T) and the target mask (B, T) marking positions to predict."""
    T = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), T), pad, dtype=torch.long)
    target = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (ids, n_prompt) in enumerate(rows):
        tokens[b, : len(ids)] = torch.tensor(ids)
        target[b, n_prompt : len(ids)] = True
    return tokens, target


async def run_sft(
    model: torch.nn.Module,
    make_env: Callable[[], Env],
    tokenizer: Tokenizer,
    cfg: SFTSection,
    *,
    seed: int = 0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """Warm-start ``model``; returns one record per step done.

    ``should_stop`` is polled before each step: True ends the warm start early.
    Each step runs in a worker thread, so the event loop (and the signal
    handlers a stop comes from) stays live while it computes: a stop asked
    during step k ends the warm start after it. Run on the loop, a single
    ``sleep(0)`` between steps is not enough for that: asyncio's signal
    delivery takes three loop turns (wakeup fd, ``_handle_signal``, the
    handler), and two more steps ran (minutes each at the h100 config's size
    on CPU).
    """
    env = make_env()
    rng = random.Random(seed)
    prompts = await sft_prompts(make_env, tokenizer, min(cfg.steps * cfg.batch_size, cfg.num_prompts), seed)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    causal = CausalInputs(device)  # position ids and causal masks, made once per length
    # the learner's precision rule: bf16 parameters are stepped through fp32 master weights
    opt, master = adamw_with_precision(params, lr=cfg.lr)
    end = [tokenizer.stop_token_ids[0]]

    def optimizer_step(tokens: torch.Tensor, target: torch.Tensor, lr: float) -> float:
        """One AdamW step on the mean target-token NLL; returns the loss."""
        dev.make_current(device)  # a worker thread starts on CUDA device 0, whatever the model's is
        for group in opt.param_groups:
            group["lr"] = lr
        tokens, target = tokens.to(device), target.to(device)
        positions, attention_mask = causal(*tokens.shape)
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=attention_mask)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
        nll = -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, T-1)
        mask = target[:, 1:]
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        if master is not None:
            master.zero_grad()
        loss.backward()
        if master is not None:
            master.accumulate_grads()
        torch.nn.utils.clip_grad_norm_(master.master_params if master is not None else params, 1.0)
        opt.step()
        if master is not None:
            master.copy_to_model()
        return float(loss.detach())

    model.train()
    history = []
    started = time.perf_counter()
    try:
        for step in range(cfg.steps):
            if should_stop is not None and should_stop():
                break
            lr = cfg.lr * lr_factor(
                step,
                schedule=cfg.schedule,
                warmup_steps=cfg.warmup_steps,
                total_steps=cfg.steps,
                min_lr_ratio=cfg.min_lr_ratio,
            )
            rows = []
            for _ in range(cfg.batch_size):
                task, prompt = prompts[rng.randrange(len(prompts))]
                reply = tokenizer.encode(env.random_action(task, rng).text) + end
                rows.append((prompt + reply, len(prompt)))
            tokens, target = _batch(rows, tokenizer.pad_token_id)  # on the host, copied to the device once
            loss = await asyncio.to_thread(optimizer_step, tokens, target, lr)
            record = {"sft_step": step + 1, "loss": loss, "lr": lr, "time_s": time.perf_counter() - started}
            history.append(record)
            if on_step is not None:
                on_step(record)
    finally:
        await env.close()
    return history
