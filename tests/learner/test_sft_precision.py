"""The SFT warm start steps bf16 parameters through fp32 master weights, like the learner."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from labrl.envs import make
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.learners import precision as prec
from labrl.harness.models import get_preset
from labrl.harness.rollout.sft import SFTSection, run_sft
from labrl.harness.tokenizer import ByteTokenizer

SMALL = get_preset("tiny-moe").model_copy(
    update={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 32}
)


def _three_steps(dtype: torch.dtype) -> tuple[torch.Tensor, prec.FP32MasterParams | None]:
    """AdamW (lr 1e-3) pushes a weight of 1.0 down by ~1e-3 per step for 3 steps."""
    p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt, master = prec.adamw_with_precision([p], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        p.grad = torch.ones_like(p)
        if master is not None:
            master.accumulate_grads()
        opt.step()
        if master is not None:
            master.copy_to_model()
    return p.detach(), master


def test_optimizer_choice_follows_the_parameter_dtype():
    p32, master32 = _three_steps(torch.float32)
    assert master32 is None
    assert torch.allclose(p32, torch.full((4,), 0.997), atol=1e-6)
    p16, master16 = _three_steps(torch.bfloat16)
    assert master16 is not None and master16.master_params[0].dtype == torch.float32
    assert torch.allclose(master16.master_params[0].detach(), torch.full((4,), 0.997), atol=1e-6)
    # bf16 spacing below 1.0 is 2**-8: 0.997 rounds to 1 - 2**-8; the model keeps bf16
    assert p16.dtype == torch.bfloat16 and torch.equal(p16, torch.full((4,), 1 - 2**-8, dtype=torch.bfloat16))


def test_plain_adamw_on_bf16_loses_the_same_updates():
    """Why: stepping bf16 parameters directly rounds each 1e-3 update away (half a bf16 ulp is ~2e-3)."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.timeout(300)
def test_sft_under_bf16_uses_fp32_master_weights(monkeypatch):
    learner = MegatronLearner(LearnerConfig(model=SMALL, precision="bf16"))
    assert learner.master is not None  # the learner's own rule, which SFT must follow
    made: list[prec.FP32MasterParams | None] = []
    real = prec.adamw_with_precision

    def spy(params, **kw):
        opt, master = real(params, **kw)
        made.append(master)
        return opt, master

    monkeypatch.setattr("labrl.harness.rollout.sft.adamw_with_precision", spy)
    before = {k: v.clone() for k, v in learner.model.state_dict().items() if isinstance(v, torch.Tensor)}
    cfg = SFTSection(enabled=True, steps=2, batch_size=2, lr=1e-3, num_prompts=4)
    history = asyncio.run(
        run_sft(learner.model, lambda: make("xrd/phase-id-v0"), ByteTokenizer(), cfg, seed=0)
    )
    assert [h["sft_step"] for h in history] == [1, 2] and all(h["loss"] == h["loss"] for h in history)
    (master,) = made
    assert master is not None and all(m.dtype == torch.float32 for m in master.master_params)
    assert all(p.dtype == torch.bfloat16 for p in learner.model.parameters())
    for p, m in zip(master.model_params, master.master_params, strict=True):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))  # the model holds bf16(master)
    after = learner.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(300)
def test_sft_cosine_schedule_decays_the_lr_to_its_floor():
    model = MegatronLearner(LearnerConfig(model=SMALL, precision="fp32")).model
    cfg = SFTSection(
        enabled=True, steps=5, batch_size=2, lr=1e-3, num_prompts=4, schedule="cosine", min_lr_ratio=0.1
    )
    history = asyncio.run(run_sft(model, lambda: make("xrd/phase-id-v0"), ByteTokenizer(), cfg, seed=0))
    # lr * (0.1 + 0.9 * (1 + cos(pi * step / 5)) / 2) at steps 0..4
    expected = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 5))) for s in range(5)]
    assert [h["lr"] for h in history] == pytest.approx(expected)
    constant = asyncio.run(
        run_sft(
            model,
            lambda: make("xrd/phase-id-v0"),
            ByteTokenizer(),
            cfg.model_copy(update={"schedule": "constant"}),
            seed=0,
        )
    )
    assert [h["lr"] for h in constant] == [1e-3] * 5
