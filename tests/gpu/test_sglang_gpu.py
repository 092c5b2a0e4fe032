"""On a GPU node: a real SGLang server on an exported small MoE, against the megatron-core learner's model.

Run with ``pytest -m gpu tests/gpu`` (needs CUDA, and SGLang in its own environment: docs/gpu.md).
The 5-step pipeline run (``labrl train`` with ``sampler.kind: sglang``) is in
``test_pipeline_gpu.py``.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from labrl.harness.models.build import build_gpt_model, causal_attention_mask
from labrl.harness.models.hf_export import TINY_MOE_QWEN3, export_hf_checkpoint
from labrl.harness.models.routing import replay_routing
from labrl.harness.samplers.sglang.launch import Supervisor, server_command
from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams
from labrl.ports import free_port

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu")
    model = build_gpt_model(TINY_MOE_QWEN3, seed=0)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    ckpt = export_hf_checkpoint(state, TINY_MOE_QWEN3, tmp / "hf")
    port = free_port()
    cmd = server_command(
        str(ckpt), "127.0.0.1", port, ["--mem-fraction-static", "0.2", "--dtype", "float32"],
        launcher=f"{sys.executable} -m sglang.launch_server",
    )  # fmt: skip
    sup = Supervisor(cmd, f"http://127.0.0.1:{port}", ready_timeout_s=900, max_restarts=0)
    sup.start()
    yield sup.url, model, tmp
    sup.stop()


def _sampler(url, tmp):
    cfg = TINY_MOE_QWEN3
    return SGLangSampler(
        SGLangSamplerConfig(
            urls=(url,), num_hidden_layers=cfg.num_layers, moe_layers=tuple(cfg.moe_layer_indices),
            topk=cfg.moe_router_topk, export_dir=str(tmp / "exports"),
        ),
        weight_writer=lambda w, p: export_hf_checkpoint(w, cfg, p, tokenizer=False),
    )  # fmt: skip


def _learner_logprobs(model, tokens, n_out, routed=None):
    ids = torch.tensor([tokens], device="cuda")
    pos = torch.arange(len(tokens), device="cuda")[None]
    with torch.no_grad():
        if routed is None:
            logits = model(ids, pos, causal_attention_mask(len(tokens), "cuda"))
        else:
            with replay_routing(model, torch.as_tensor(routed, device="cuda")[None].long()):
                logits = model(ids, pos, causal_attention_mask(len(tokens), "cuda"))
    logp = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return logp[-n_out:].cpu().numpy()


async def test_logprobs_match_learner_and_routing_replays(server):
    url, model, tmp = server
    async with _sampler(url, tmp) as sampler:
        req = GenerateRequest(
            rid="g/0", input_ids=tuple(range(10, 40)), sampling=SamplingParams(max_new_tokens=24),
            return_routed_experts=True,
        )  # fmt: skip
        (res,) = await sampler.generate([req])
    tokens = list(req.input_ids) + res.output_ids
    free = _learner_logprobs(model.eval(), tokens, len(res.output_ids))
    assert np.abs(free - np.array(res.logprobs_T)).max() < 2e-2  # fp32 server vs fp32 learner
    replayed = _learner_logprobs(model, tokens, len(res.output_ids), res.routed_experts_T_L_K)
    assert (
        np.abs(replayed - np.array(res.logprobs_T)).max()
        <= np.abs(free - np.array(res.logprobs_T)).max() + 1e-6
    )


async def test_inflight_disk_update_tags_versions(server):
    url, model, tmp = server
    async with _sampler(url, tmp) as sampler:
        state = {k: v.cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        await sampler.update_weights(state, sampler.version + 1)
        req = GenerateRequest(rid="v/0", input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=8))
        (res,) = await sampler.generate([req])
        assert res.versions_T == [sampler.version] * len(res.output_ids)
