"""The GPU path with the in-process components (no SGLang): run on a CUDA machine.

``pytest -m gpu tests/gpu/test_gpu_path.py`` (``benchmarks/gpu_check.sh`` runs it
with the rest). Device ``auto`` puts the learner and the local sampler on
``cuda``; they are asked for bf16 explicitly (``auto`` keeps a model this small
in fp32), with the TransformerEngine spec when TE imports and the local spec
otherwise (both are covered: whichever this machine has).
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import torch
from rollout_builders import as_trajectories, random_requests
from run_configs import replay_training

from labrl.harness import objectives
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig
from labrl.harness.models import get_preset
from labrl.harness.models.routing import model_router_replays, replay_routing
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig

pytestmark = pytest.mark.gpu
TINY = get_preset("tiny-moe")


def _batch(sampler: LocalSampler, n: int = 8, seed: int = 0):
    reqs = random_requests(n, prompt_len=16, seed=seed)
    results = asyncio.run(sampler.generate(reqs))
    return collate(as_trajectories(reqs, results), pad_token_id=256)


@pytest.fixture(scope="module")
def learner() -> MegatronLearner:
    return MegatronLearner(
        LearnerConfig(
            micro_batch_size=4,
            precision="bf16",
            optimizer=OptimizerConfig(lr=3e-4),
            objective=objectives.ObjectiveConfig(loss="reinforce"),
        )
    )


@pytest.fixture(scope="module")
def sampler(learner) -> LocalSampler:
    config = LocalSamplerConfig(precision="bf16")
    return LocalSampler(TINY, config, weights=learner.export_weights(), version=learner.version)


def test_auto_device_and_bf16_on_cuda(learner, sampler):
    for model in (learner.model, sampler.model):
        p = next(model.parameters())
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16
    assert learner.master is not None and learner.master.master_params[0].dtype == torch.float32
    assert learner.optimizer.defaults["fused"] is True  # device.adamw_kernel on CUDA


def test_auto_precision_keeps_a_small_model_in_fp32_on_cuda():
    small = LocalSampler(TINY, LocalSamplerConfig())
    p = next(small.model.parameters())
    assert p.device.type == "cuda" and p.dtype == torch.float32


def test_learner_loss_falls_on_cuda(learner, sampler):
    batch = _batch(sampler, seed=1)
    old = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
    prepared = objectives.prepare(
        learner.config.objective, objectives.ObjectiveInputs.from_train_batch(batch, old, learner.version)
    )

    def objective() -> float:
        logp = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
        return float(objectives.policy_loss(learner.config.objective, logp, prepared)[0])

    values = [objective()]
    for _ in range(5):
        metrics = learner.train_step(batch)
        assert metrics["learner/router_replay"] == 1.0
        values.append(objective())
    assert values[-1] < values[0], values
    assert sum(b < a for a, b in itertools.pairwise(values)) >= 4, values


def test_sampler_generation_captures_the_learners_routing(learner, sampler):
    asyncio.run(sampler.update_weights(learner.export_weights(), learner.version))
    batch = _batch(sampler, seed=2)
    routed = batch.routed_experts_B_T_L_K
    assert routed is not None and routed.shape[2:] == (TINY.num_moe_layers, TINY.moe_router_topk)
    own = learner.route(batch.tokens_B_T).sort(-1).values
    real = batch.attention_mask_B_T.clone()
    real[torch.arange(batch.batch_size), batch.attention_mask_B_T.sum(1) - 1] = False  # padded last row
    same = (own == routed.sort(-1).values).all(-1).all(-1)[real]
    # same weights and dtype; batch shapes differ (prefill/decode vs one forward): near-ties may flip
    assert float(same.float().mean()) > 0.9


def test_router_replay_on_cuda_routes_to_the_captured_experts(learner, sampler):
    from megatron.core.transformer.moe.router import TopKRouter

    batch = _batch(sampler, seed=3)
    tokens = batch.tokens_B_T.to(learner.device)
    # replay a routing that no router would pick by itself: experts reversed
    routed = (TINY.num_experts - 1 - batch.routed_experts_B_T_L_K).to(learner.device)
    maps: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach()))
        for m in learner.model.modules()
        if isinstance(m, TopKRouter)
    ]
    try:
        with replay_routing(learner.model, routed), torch.no_grad():
            learner._logits(tokens)
    finally:
        for h in hooks:
            h.remove()
    B, T, L, _ = routed.shape
    for layer, routing_map in enumerate(maps):  # (T * B, E) bool, sequence-major tokens
        want = torch.zeros(T, B, TINY.num_experts, dtype=torch.bool, device=learner.device)
        want.scatter_(-1, routed[:, :, layer].permute(1, 0, 2), True)
        assert torch.equal(routing_map.reshape(T, B, -1).bool(), want), f"layer {layer}"
    assert len(maps) == L and all(r.router_replay_action is None for r in model_router_replays(learner.model))


def test_checkpoint_save_resume_on_cuda(learner, sampler, tmp_path):
    batch_a, batch_b = _batch(sampler, n=4, seed=4), _batch(sampler, n=4, seed=5)
    learner.train_step(batch_a)
    path = str(tmp_path / "learner.pt")
    learner.save_checkpoint(path)
    m1 = learner.train_step(batch_b)
    resumed = MegatronLearner(learner.config.model_copy(update={"seed": 99}))
    resumed.load_checkpoint(path)
    m2 = resumed.train_step(batch_b)
    w1, w2 = learner.export_weights(), resumed.export_weights()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert m1["loss/total"] == m2["loss/total"]


def test_hf_export_of_a_cuda_learner_loads_in_transformers(learner, tmp_path):
    from transformers import AutoModelForCausalLM

    from labrl.harness.models.hf_export import export_hf_checkpoint

    path = export_hf_checkpoint(learner.export_weights(), TINY, tmp_path / "hf")
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == TINY.num_layers
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(learner.device).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logp = torch.log_softmax(hf(input_ids=ids.to(learner.device)).logits.float(), -1)
    ours = learner.logprobs(ids)  # token-aligned: position t scores token t from t-1
    theirs = hf_logp[:, :-1].gather(-1, ids[:, 1:, None].to(learner.device)).squeeze(-1).cpu()
    # two bf16 implementations (different kernels): agreement to bf16 tolerance
    assert float((ours[:, 1:] - theirs).abs().mean()) < 0.05


def test_pipeline_in_process_with_the_local_sampler_on_cuda(tmp_path):
    from labrl.harness.config import build_run_config
    from labrl.harness.pipeline.runner import train

    run = tmp_path / "run"
    config = {
        "env": {
            "id": "xrd/phase-id-v0",
            "options": {
                "tier": 1,
                "n_peaks": 6,
                "n_candidates": 4,
                "phase_pool": 8,
                "answer_format": "formula",
            },
        },
        "model": {"preset": "tiny-moe", "overrides": {"max_sequence_length": 256, "num_layers": 2}},
        "sampler": {"kind": "local", "local": {"max_batch_size": 32}, "max_new_tokens": 6},
        **replay_training(16),
        # a from-scratch policy (no warm start) gets every answer wrong: with dynamic sampling every
        # group would be dropped and the run stall (seen on an H100), so train on every group
        "objective": {"loss": "cispo", "corrections": ["m2po"], "advantages": "whiten"},
        "pipeline": {
            "mode": "pipeline",
            "batch_groups": 4,
            "group_size": 4,
            "total_steps": 4,
            "dynamic_sampling": False,
            "progress": False,
        },
        "run_dir": str(run),
    }
    summary = asyncio.run(train(build_run_config(config)))
    assert summary["step"] == 4
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["learner/router_replay"] == 1.0 for r in rows)
    assert all(r["samples/trained"] == 16 for r in rows)
