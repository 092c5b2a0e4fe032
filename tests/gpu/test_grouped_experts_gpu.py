"""``TorchGroupedMLP`` on CUDA: torch's bf16 grouped_mm kernel against ``SequentialMLP`` on the same weights.

The CPU suite (tests/learner/test_grouped_experts.py) checks the module on torch's CPU
``grouped_mm``; here the CUDA kernel (CUTLASS on SM90/SM100) runs forward and backward,
with an expert that gets no tokens, and ``auto`` is checked to choose it in bf16 without TE.
"""

from __future__ import annotations

import pytest
import torch
from lm_backward import logits_after_backward

from labrl.harness.models import build_gpt_model, causal_attention_mask, get_preset
from labrl.harness.models import device as dev

pytestmark = pytest.mark.gpu
# hidden 128 and expert FFN 64: 16-byte-aligned bf16 strides
MODEL = get_preset("tiny-moe").model_copy(update={"num_layers": 2, "moe_ffn_hidden_size": 64})
BF16_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}


def test_auto_chooses_grouped_mm_in_bf16_without_te():
    caps = dev.detect_capabilities()
    device = dev.resolve_device("auto", caps)
    choice = dev.experts_module(device, caps, torch.bfloat16)
    want = "TEGroupedMLP" if caps.transformer_engine else "TorchGroupedMLP"
    assert choice.name == want, choice


def test_grouped_mm_equals_sequential_mlp_on_cuda():
    if dev.detect_capabilities().transformer_engine:
        pytest.skip("with TransformerEngine the experts are TEGroupedMLP")
    device = torch.device("cuda", torch.cuda.current_device())
    seq, grp = (
        build_gpt_model(MODEL, seed=3, device=device, dtype=torch.bfloat16, experts=e)
        for e in ("sequential", "grouped_mm")
    )
    assert type(grp.decoder.layers[0].mlp.experts).__name__ == "TorchGroupedMLP"
    grp.load_state_dict(seq.state_dict(), strict=True)  # the same weights, whichever init path CUDA took
    tokens = torch.randint(0, 256, (4, 64), device=device, generator=torch.Generator(device).manual_seed(0))
    positions = torch.arange(64, device=device).expand(4, 64)
    mask = causal_attention_mask(64, device=device)
    logits = [logits_after_backward(model, tokens, positions, mask) for model in (seq, grp)]
    torch.testing.assert_close(logits[1], logits[0], **BF16_TOLERANCE)
    for layer in range(MODEL.num_layers):
        s, g = seq.decoder.layers[layer].mlp.experts, grp.decoder.layers[layer].mlp.experts
        for e, expert in enumerate(s.local_experts):
            torch.testing.assert_close(
                g.weight1.grad[e].float(), expert.linear_fc1.weight.grad.float(), **BF16_TOLERANCE
            )
            torch.testing.assert_close(
                g.weight2.grad[e].float(), expert.linear_fc2.weight.grad.float(), **BF16_TOLERANCE
            )
    # an expert with no tokens: an empty group, zero weight gradient
    experts = grp.decoder.layers[0].mlp.experts
    experts.zero_grad(set_to_none=True)
    counts = torch.tensor([3, 0, 2, 0, 0, 0, 0, 1])
    x = torch.randn(6, MODEL.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    out, _ = experts(x, counts, torch.rand(6, device=device))
    out.float().sum().backward()
    assert float(experts.weight1.grad[1].abs().sum()) == 0 and float(experts.weight1.grad[0].abs().sum()) > 0
