"""SDPAttention on CUDA: the kernels ``device.sdpa_native_gqa`` counts on run, and agree with megatron.

Each call runs under ``sdpa_kernel`` restricted to the kernel the decision expects (flash for the
learner's causal bf16 step with grouped heads; memory-efficient for masked prefill and decode with
repeated heads): SDPA raises if that kernel refuses the call instead of falling back silently.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_builders import random_requests
from torch.nn.attention import SDPBackend, sdpa_kernel

from labrl.harness.models import device as dev
from labrl.harness.models import get_preset
from labrl.harness.models.attention import SDPAttention
from labrl.harness.models.build import causal_attention_mask, ensure_model_parallel
from labrl.harness.models.config import ParallelConfig
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig

pytestmark = pytest.mark.gpu
GQA = get_preset("tiny-moe").model_copy(update={"num_query_groups": 2})
S, B, D = 64, 3, 32
CUDA = torch.device("cuda")


def modules(dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    ensure_model_parallel(ParallelConfig(), CUDA)
    tconfig = GQA.transformer_config(ParallelConfig(), cpu=False, dtype=dtype)
    return tuple(cls(tconfig, 1, AttnMaskType.causal, "self") for cls in (DotProductAttention, SDPAttention))


def qkv(sq, dtype, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return [
        torch.randn(s, B, h, D, generator=gen, device=CUDA).to(dtype).requires_grad_()
        for s, h in ((sq, 4), (S, 2), (S, 2))
    ]


def prefill_mask() -> torch.Tensor:
    keys = torch.arange(S, device=CUDA)
    start = torch.tensor([0, 5, 40], device=CUDA)
    blocked = (keys[None, :] > keys[:, None])[None] | (keys[None, :] < start[:, None])[:, None, :]
    return blocked[:, None]


def relative_error(module, q, k, v, mask, reference) -> float:
    out = module(q, k, v, mask)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return max(
        float((a.double() - b.double()).abs().max() / b.double().abs().max())
        for a, b in zip((out, *grads), reference, strict=True)
    )


def exact(q, k, v, mask) -> tuple:
    """megatron's unfused attention in fp32 on the same (rounded) inputs."""
    unfused, _ = modules(torch.float32)
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = unfused(q, k, v, mask)
    return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))


@pytest.mark.parametrize(
    ("case", "dtype", "backend"),
    [
        ("causal", torch.bfloat16, SDPBackend.FLASH_ATTENTION),
        ("causal", torch.float32, SDPBackend.EFFICIENT_ATTENTION),
        ("prefill", torch.bfloat16, SDPBackend.EFFICIENT_ATTENTION),
        ("decode", torch.bfloat16, SDPBackend.EFFICIENT_ATTENTION),
        ("prefill", torch.float32, SDPBackend.EFFICIENT_ATTENTION),
    ],
)
def test_the_expected_kernel_runs_and_agrees_with_megatron(case, dtype, backend):
    sq = 1 if case == "decode" else S
    mask = {"causal": causal_attention_mask(S, device=CUDA), "prefill": prefill_mask()}.get(case)
    if case == "decode":
        mask = torch.zeros(B, 1, 1, S, dtype=torch.bool, device=CUDA)
        mask[2, ..., :40] = True
    assert dev.sdpa_native_gqa(CUDA, dtype, case != "causal") == (backend == SDPBackend.FLASH_ATTENTION)
    q, k, v = qkv(sq, dtype)
    reference = exact(q, k, v, mask)
    unfused, sdpa = modules(dtype)
    with sdpa_kernel([backend]):
        sdpa_err = relative_error(sdpa, q, k, v, mask, reference)
    megatron_err = relative_error(unfused, q, k, v, mask, reference)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert sdpa_err <= tol, (sdpa_err, megatron_err)


def test_local_sampler_on_cuda_gives_the_same_tokens_with_each_attention(monkeypatch):
    reqs = random_requests(6, prompt_len=20, max_new=10, seed=4)
    results = {}
    for kernel in ("unfused", "sdpa"):
        monkeypatch.setattr(dev, "core_attention", lambda device, caps, kernel=kernel: kernel)
        sampler = LocalSampler(GQA, LocalSamplerConfig(precision="fp32", seed=1, max_batch_size=4))
        results[kernel] = asyncio.run(sampler.generate(reqs))
    for a, b in zip(results["unfused"], results["sdpa"], strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(b.logprobs_T), torch.tensor(a.logprobs_T), atol=1e-4, rtol=0)
