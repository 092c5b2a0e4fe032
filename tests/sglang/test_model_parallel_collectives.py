"""The learner's TP/EP collectives over megatron-core's real process groups, 2 gloo processes on CPU.

- export: each rank holds a real TP (or EP) shard of a model's state; ``gather_full_state``
  (what ``MegatronLearner.export_weights`` returns) must equal the TP=1 state on every rank;
- router replay under sequence parallelism: routes recorded on each rank's sequence slice are
  gathered into the whole sequence's, and replay hands each rank back exactly its slice.
"""

from __future__ import annotations

import model_parallel_worker as worker
import pytest
import torch
from spawn_ranks import spawn_ranks
from weight_sync_support import MODELS, megatron_state, model_parallel_shards

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.learners.model_parallel import ModelParallelSizes, gather_full_state, sequence_parallel
from labrl.harness.models.routing import from_megatron_layout

pytestmark = pytest.mark.timeout(400)


def test_single_process_export_is_the_local_state_unchanged():
    """TP = EP = 1 (the CPU path): no collective, the export is the model's state."""
    learner = MegatronLearner(LearnerConfig(model=MODELS["qwen3_moe"]))
    state = learner.export_weights()
    assert set(state) == {k for k in learner.model.state_dict() if not k.endswith("_extra_state")}
    assert all(torch.equal(state[k], v) for k, v in learner.model.state_dict().items() if k in state)
    assert gather_full_state(state, num_experts=learner.config.model.num_experts).keys() == state.keys()
    assert sequence_parallel().size == 1 and learner.sp.size == 1 and learner.sp.group is None


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)])
def test_export_gathers_real_shards_over_megatron_groups_into_the_tp1_state(tp, ep, tmp_path):
    cfg = MODELS["qwen3_moe"]
    state = megatron_state(cfg, seed=3)
    shards = model_parallel_shards(state, tp=tp, ep=ep, num_experts=cfg.num_experts)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    if tp == 2:  # each rank really holds a piece
        assert shards[(1, 0)][qkv].shape[0] == state[qkv].shape[0] // 2
    else:
        assert len([k for k in shards[(0, 1)] if ".local_experts." in k]) * 2 == len(
            [k for k in state if ".local_experts." in k]
        )
    torch.save({"shards": shards, "num_experts": cfg.num_experts}, tmp_path / "shards.pt")
    results = spawn_ranks(worker.export_main, (tp, ep, str(tmp_path / "shards.pt"), str(tmp_path)), tmp_path)
    assert sorted(r["rank"] for r in results) == sorted(shards)
    for r in results:
        assert r["sizes"] == ModelParallelSizes(tp=tp, ep=ep, expert_tp=tp)
        assert set(r["state"]) == set(state)
        for name, full in state.items():
            assert torch.equal(r["state"][name], full), (r["rank"], name)


def test_router_replay_gathers_and_scatters_sequence_parallel_routes(tmp_path):
    results = spawn_ranks(worker.routing_main, (str(tmp_path),), tmp_path)
    assert [r["sp"] for r in results] == [(0, 2), (1, 2)]
    whole = [s.topk(worker.K, dim=-1).indices for s in worker.scores()]  # TP=1 routes, per layer [T*B, K]
    want = from_megatron_layout(whole, worker.B)
    for r in results:
        assert torch.equal(r["gathered"], want)  # every rank holds the whole sequence's routes
    for rank, r in enumerate(results):
        for layer, idx in enumerate(r["replayed"]):  # each rank replays exactly its sequence slice
            assert torch.equal(idx, whole[layer].chunk(2, dim=0)[rank])
            assert not torch.equal(idx, (-worker.scores()[layer]).topk(worker.K).indices.chunk(2)[rank])
