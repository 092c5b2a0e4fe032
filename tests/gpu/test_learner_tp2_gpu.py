"""megatron-core's real TP=2 model (2 GPUs, NCCL): the learner's export is the TP=1 state and router
replay under sequence parallelism gives back the learner's own routing."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import tp2_worker
from weight_sync_support import MODELS, model_parallel_shards, transformers_checkpoint_layout

from labrl.harness.models.hf_export import hf_weights
from labrl.ports import free_port

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs"),
    pytest.mark.timeout(600),
]


def test_tp2_export_and_sequence_parallel_router_replay(tmp_path):
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=tp2_worker.rank_main, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=540)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    cfg = MODELS["qwen3_moe"]
    full = ranks[0]["full"]
    assert all(torch.equal(full[k], ranks[1]["full"][k]) for k in full)
    # the gather inverts megatron's real sharding: cut again, each rank's piece is what it holds
    recut = model_parallel_shards(full, tp=2, ep=1, num_experts=cfg.num_experts)
    for r in range(2):
        local = ranks[r]["local"]
        assert set(recut[(r, 0)]) == set(local)
        assert all(torch.equal(recut[(r, 0)][k], v) for k, v in local.items())
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert full[qkv].shape[0] == 2 * ranks[0]["local"][qkv].shape[0]
    sent = {k: (tuple(v.shape), v.dtype) for k, v in hf_weights(full, cfg).items()}
    assert sent == transformers_checkpoint_layout(cfg, torch.float32)
    # routes: gathered whole-sequence on both ranks; replaying them reproduces the free forward
    B, T = tp2_worker.B, tp2_worker.T
    assert ranks[0]["sp"] == 2
    assert ranks[0]["routed"].shape == (B, T, cfg.num_moe_layers, cfg.moe_router_topk)
    assert torch.equal(ranks[0]["routed"], ranks[1]["routed"])
    for r in ranks:
        torch.testing.assert_close(r["replayed"], r["free"], atol=1e-5, rtol=0)
