"""A model with dense and MoE layers end to end: HF export, fake SGLang server, routed experts.

The fake server serves the exported checkpoint with LocalSampler and sends
routed experts over all 4 hidden layers (dense rows are zeros, as SGLang
leaves them); SGLangSampler maps them back to the 2 MoE layers, which must
equal what megatron-core's routers pick on the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from labrl.harness.models.build import build_gpt_model, causal_attention_mask
from labrl.harness.models.hf_export import TINY_MOE_QWEN3, export_hf_checkpoint
from labrl.harness.models.routing import from_megatron_layout, record_routing, recorded
from labrl.harness.samplers.local import LocalSampler
from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams
from labrl.testing.fake_sglang_server import local_fake_server

pytestmark = pytest.mark.timeout(120)

MIXED = TINY_MOE_QWEN3.model_copy(
    update={
        "name": "mixed-qwen3",
        "num_layers": 4,
        "moe_layer_freq": 2,  # MoE layers 0 and 2, dense 1 and 3
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "moe_ffn_hidden_size": 48,
        "max_sequence_length": 64,
    }
)


def _weights() -> dict[str, torch.Tensor]:
    torch.set_num_threads(2)
    model = build_gpt_model(MIXED, seed=5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen))  # decisive routing: no near-ties
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _megatron_routing(state: dict[str, torch.Tensor], tokens: list[int]) -> np.ndarray:
    model = build_gpt_model(MIXED, seed=0).eval()
    model.load_state_dict(state, strict=False)
    ids = torch.tensor([tokens])
    T = len(tokens)
    with record_routing(model) as replays, torch.no_grad():
        model(ids, torch.arange(T)[None], causal_attention_mask(T))
        per_layer = recorded(replays)
    return from_megatron_layout(per_layer, 1)[0].numpy()  # (T, 2, K)


async def test_routed_experts_of_moe_layers_round_trip_through_the_fake_server(served, tmp_path):
    state = _weights()
    path = export_hf_checkpoint(state, MIXED, tmp_path / "hf", tokenizer=False)
    url = served(local_fake_server(str(path)))
    cfg = SGLangSamplerConfig(
        urls=(url,),
        num_hidden_layers=4,
        moe_layers=tuple(MIXED.moe_layer_indices),
        topk=2,
        export_dir=str(tmp_path / "exports"),
        retry_backoff_s=0.0,
    )
    request = GenerateRequest(
        rid="mixed/0",
        input_ids=(5, 17, 99, 3, 250, 64),
        sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
        return_routed_experts=True,
    )
    writer = lambda w, p: export_hf_checkpoint(w, MIXED, p, tokenizer=False)  # noqa: E731
    async with SGLangSampler(cfg, weight_writer=writer) as sampler:
        (res,) = await sampler.generate([request])
    # the same weights in process: same greedy tokens, same log-probs
    (local,) = await LocalSampler(MIXED, weights=state).generate([request])
    assert res.output_ids == local.output_ids and len(res.output_ids) == 6
    assert res.logprobs_T == pytest.approx(local.logprobs_T, abs=1e-5)
    tokens = [*request.input_ids, *res.output_ids]
    assert res.routed_experts_T_L_K.shape == (12, 2, 2)  # [P + N, MoE layers, top-k]
    assert np.array_equal(res.routed_experts_T_L_K, local.routed_experts_T_L_K)
    want = _megatron_routing(state, tokens)
    got = np.sort(res.routed_experts_T_L_K[:-1], -1)  # the last row is padding (never fed)
    assert np.array_equal(got, np.sort(want[:-1], -1))
    assert np.array_equal(res.routed_experts_T_L_K[-1], [[0, 1], [0, 1]])
