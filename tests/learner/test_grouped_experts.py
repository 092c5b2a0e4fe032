"""``TorchGroupedMLP`` (all experts in one ``torch.nn.functional.grouped_mm``) against ``SequentialMLP``.

The two modules are built from the same seed (the grouped one stacks the weights a
``SequentialMLP`` would get), so every comparison is on the same weights: forward and
gradients (fp32 to round-off, bf16 within bf16 rounding), experts with no tokens, the
learner's step, router replay, state-dict / checkpoint / HF-export names, and expert
parallelism over gloo.
"""

from __future__ import annotations

import pytest
import torch
from lm_backward import logits_after_backward
from spawn_ranks import spawn_ranks

from labrl.errors import ConfigError, LearnerError
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import build_gpt_model, causal_attention_mask, get_preset
from labrl.harness.models.hf_export import hf_weights
from labrl.harness.rollout.batching import collate
from labrl.harness.types import Trajectory

SMALL = get_preset("tiny-moe").model_copy(
    update={"num_layers": 2, "hidden_size": 64, "moe_ffn_hidden_size": 32}
)
# bf16 products round to 8 bits of mantissa; the two modules sum in different orders
BF16_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}
FP32_TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}


def experts_of(model, layer: int = 0):
    return model.decoder.layers[layer].mlp.experts


def expert_grads(module) -> list[torch.Tensor]:
    """Per expert ``[fc1 grad, fc2 grad]``, flattened, in SequentialMLP's order for either module."""
    if type(module).__name__ == "SequentialMLP":
        return [w for m in module.local_experts for w in (m.linear_fc1.weight.grad, m.linear_fc2.weight.grad)]
    return [
        w for e in range(module.num_local_experts) for w in (module.weight1.grad[e], module.weight2.grad[e])
    ]


def pair(dtype: torch.dtype = torch.float32, cfg=SMALL, seed: int = 3):
    return tuple(
        build_gpt_model(cfg, seed=seed, dtype=dtype, experts=e) for e in ("sequential", "grouped_mm")
    )


# -- torch's grouped_mm: the facts the module relies on -----------------------------


def test_grouped_mm_contract_on_this_torch():
    """int32 cumulative-end offsets, empty groups, 16-byte strides, and a backward that needs aligned grads."""
    from torch.nn.functional import grouped_mm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=gen, requires_grad=True)
    w = torch.randn(3, 8, 16, generator=gen, requires_grad=True)  # (E, out, in), nn.Linear's layout
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1 has no rows
    y = grouped_mm(x, w.transpose(1, 2), offs=offs)
    want = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    torch.testing.assert_close(y, want)
    y.backward(torch.ones_like(y))
    assert torch.equal(w.grad[1], torch.zeros(8, 16))  # an empty group's weight gradient is zero, not None
    with pytest.raises(RuntimeError, match="int32"):
        grouped_mm(x, w.transpose(1, 2), offs=offs.long())
    with pytest.raises(RuntimeError, match="16 bytes"):
        grouped_mm(torch.randn(10, 5), torch.randn(3, 5, 8), offs=offs)  # 5 fp32 = 20-byte rows
    y = grouped_mm(x, w.transpose(1, 2), offs=offs)
    with pytest.raises(RuntimeError, match="16 bytes"):
        y.backward(torch.ones(8, 10).T)  # a transposed gradient: strides (1, 10)


# -- the decision ---------------------------------------------------------------


def test_a_misaligned_shape_falls_back_under_auto_and_is_refused_when_asked_for():
    from labrl.harness.models import device as dev

    assert dev.grouped_mm_aligned(96, 192, torch.float32) and dev.grouped_mm_aligned(96, 192, torch.bfloat16)
    assert dev.grouped_mm_aligned(36, 16, torch.float32) and not dev.grouped_mm_aligned(
        36, 16, torch.bfloat16
    )
    odd = SMALL.model_copy(update={"hidden_size": 36, "num_attention_heads": 4})
    model = build_gpt_model(odd, experts="sequential", dtype=torch.bfloat16)
    assert type(experts_of(model)).__name__ == "SequentialMLP"
    with pytest.raises(ConfigError, match="multiples of 16 bytes"):
        build_gpt_model(odd, experts="grouped_mm", dtype=torch.bfloat16)


# -- numerics -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)]
)
def test_forward_and_gradients_equal_sequential_mlp(dtype, tol):
    seq, grp = pair(dtype)
    assert [type(experts_of(m)).__name__ for m in (seq, grp)] == ["SequentialMLP", "TorchGroupedMLP"]
    tokens = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(3, 40)
    mask = causal_attention_mask(40)
    logits = [logits_after_backward(model, tokens, positions, mask) for model in (seq, grp)]
    torch.testing.assert_close(logits[1], logits[0], **tol)
    for layer in range(SMALL.num_layers):
        got, want = expert_grads(experts_of(grp, layer)), expert_grads(experts_of(seq, layer))
        assert len(got) == len(want) == 2 * SMALL.num_experts
        assert sum(float(g.abs().sum()) for g in want) > 0
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.float(), w.float(), **tol)
    seq_rest = {n: p.grad for n, p in seq.named_parameters() if "experts" not in n}
    for name, p in grp.named_parameters():
        if "experts" not in name:  # attention, norms, router, embeddings: the gradients flowing through
            torch.testing.assert_close(p.grad.float(), seq_rest[name].float(), **tol)


@pytest.mark.parametrize(
    "counts", [[0, 5, 0, 3, 0, 0, 4, 0], [0] * 8, [12, 0, 0, 0, 0, 0, 0, 0]], ids=["some", "none", "one"]
)
def test_experts_without_tokens(counts):
    """Experts with no rows (and a call with no rows at all) give SequentialMLP's output and zero gradients."""
    seq, grp = (experts_of(m) for m in pair())
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(sum(counts), SMALL.hidden_size, generator=gen)
    probs = torch.rand(sum(counts), generator=gen)
    outs, x_grads = [], []
    for module in (seq, grp):
        x = x0.clone().requires_grad_(True)
        out, bias = module(x, torch.tensor(counts), probs)
        assert bias is None and out.shape == x0.shape
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        outs.append(out)
        x_grads.append(x.grad)
    torch.testing.assert_close(outs[1], outs[0], **FP32_TOLERANCE)
    torch.testing.assert_close(x_grads[1], x_grads[0], **FP32_TOLERANCE)
    got, want = expert_grads(grp), expert_grads(seq)
    for e, n in enumerate(counts):
        for g, w in zip(got[2 * e : 2 * e + 2], want[2 * e : 2 * e + 2], strict=True):
            torch.testing.assert_close(g, w, **FP32_TOLERANCE)
            assert (float(g.abs().sum()) == 0) == (n == 0)


def test_probabilities_scale_each_tokens_output():
    """Doubling one token's routing probability doubles its output row (probs scale the activation)."""
    grp = experts_of(pair()[1])
    x = torch.randn(6, SMALL.hidden_size)
    counts = torch.tensor([2, 1, 0, 3, 0, 0, 0, 0])
    probs = torch.full((6,), 0.25)
    with torch.no_grad():
        base, _ = grp(x, counts, probs)
        probs[4] = 0.5
        doubled, _ = grp(x, counts, probs)
    torch.testing.assert_close(doubled[4], 2 * base[4])
    torch.testing.assert_close(doubled[[0, 1, 2, 3, 5]], base[[0, 1, 2, 3, 5]])


def test_probabilities_on_the_input_as_sequential_mlp_applies_them():
    """``moe_apply_probs_on_input`` (top-1 only): inputs scaled by their probability, outputs not."""
    import copy

    seq, grp = (experts_of(m) for m in pair())
    for module in (seq, grp):
        module.config = copy.copy(module.config)
        module.config.moe_apply_probs_on_input, module.config.moe_router_topk = True, 1
    x, counts, probs = (
        torch.randn(5, SMALL.hidden_size),
        torch.tensor([2, 0, 3, 0, 0, 0, 0, 0]),
        torch.rand(5),
    )
    with torch.no_grad():
        torch.testing.assert_close(grp(x, counts, probs)[0], seq(x, counts, probs)[0], **FP32_TOLERANCE)
        assert not torch.allclose(grp(x, counts, probs)[0], grp(x, counts, torch.ones(5))[0])
    grp.config.moe_router_topk = 2
    with pytest.raises(ConfigError, match="moe_router_topk=1"):
        grp(x, counts, probs)


def test_what_it_does_not_compute_is_refused_at_build_time():
    import copy

    from labrl.harness.models.grouped_experts import TorchGroupedMLP

    config = copy.copy(experts_of(pair()[1]).config)
    config.add_bias_linear, config.bias_activation_fusion = True, True
    with pytest.raises(ConfigError, match=r"add_bias_linear \(expert biases\), bias_activation_fusion"):
        TorchGroupedMLP(8, config, submodules=None)


def test_a_transposed_output_gradient_is_accepted():
    """grouped_mm's backward refuses unaligned gradient strides; the module hands it a contiguous one."""
    grp = experts_of(pair()[1])
    x = torch.randn(6, SMALL.hidden_size, requires_grad=True)
    out, _ = grp(x, torch.tensor([2, 1, 0, 3, 0, 0, 0, 0]), torch.rand(6))
    out.backward(torch.ones(SMALL.hidden_size, 6).T)  # strides (1, 6): 24 bytes
    assert x.grad is not None and float(grp.weight2.grad.abs().sum()) > 0


def test_parallel_attributes_follow_sequential_mlps():
    """What the grad-norm reduction reads: allreduce (False under expert parallelism) and the TP flags."""
    seq, grp = (experts_of(m) for m in pair())
    for stacked, linear in (
        (grp.weight1, seq.local_experts[0].linear_fc1),
        (grp.weight2, seq.local_experts[0].linear_fc2),
    ):
        assert stacked.allreduce == linear.weight.allreduce
        assert stacked.tensor_model_parallel == linear.weight.tensor_model_parallel
        assert stacked.partition_dim == linear.weight.partition_dim + 1  # behind the new expert axis


# -- names: state dict, checkpoint, HF export -----------------------------------------


def test_state_dict_and_hf_weights_are_sequential_mlps():
    seq, grp = pair()
    s, g = seq.state_dict(), grp.state_dict()
    assert list(g) == list(s)  # same keys in the same order, _extra_state included
    assert all(torch.equal(g[k], v) for k, v in s.items() if isinstance(v, torch.Tensor))
    hs, hg = hf_weights(s, SMALL), hf_weights(g, SMALL)
    assert list(hg) == list(hs) and all(torch.equal(hg[k], v) for k, v in hs.items())
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in hg  # the SGLang (Mixtral) name map


def test_either_module_loads_the_others_weights_strictly():
    seq = build_gpt_model(SMALL, seed=1, experts="sequential")
    grp = build_gpt_model(SMALL, seed=2, experts="grouped_mm")
    assert not torch.equal(experts_of(grp).weight1, experts_of(seq).local_experts[0].linear_fc1.weight[None])
    grp.load_state_dict(seq.state_dict(), strict=True)
    assert all(torch.equal(grp.state_dict()[k], v) for k, v in seq.state_dict().items() if v is not None)
    other = build_gpt_model(SMALL, seed=5, experts="sequential")
    other.load_state_dict(grp.state_dict(), strict=True)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in seq.state_dict().items() if v is not None)
    broken = {k: v for k, v in seq.state_dict().items() if "local_experts.3.linear_fc2.weight" not in k}
    result = grp.load_state_dict(broken, strict=False)
    assert result.missing_keys == ["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
                                   "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]  # fmt: skip
    with pytest.raises(RuntimeError, match=r"Unexpected key.*local_experts\.8"):
        extra = dict(seq.state_dict()) | {
            "decoder.layers.0.mlp.experts.local_experts.8.linear_fc1.weight": None
        }
        grp.load_state_dict(extra, strict=True)


# -- the learner ------------------------------------------------------------------------

TIMINGS = ("learner/step_s", "learner/tokens_per_s")


@pytest.fixture
def sampled_batch_small():
    """8 rows of 24 tokens in 2 groups with mixed rewards (non-zero advantages), behaviour log-prob -1."""
    gen = torch.Generator().manual_seed(4)
    trajs = [
        Trajectory(
            env_id="test/grouped", task_id=f"t{b}", group_id=f"g{b // 4}",
            tokens_T=torch.randint(0, 256, (24,), generator=gen).tolist(), loss_mask_T=[0] * 12 + [1] * 12,
            logprobs_T=[-1.0] * 24, versions_T=[0] * 24, reward=float(b % 2), outcome="ok",
            finish_reason="stop", num_turns=1,
        )
        for b in range(8)
    ]  # fmt: skip
    return collate(trajs, pad_token_id=0)


def learner_pair(**overrides) -> tuple[MegatronLearner, MegatronLearner]:
    return tuple(
        MegatronLearner(LearnerConfig(model=SMALL, micro_batch_size=4, experts=e, **overrides))
        for e in ("sequential", "grouped_mm")
    )


def test_learner_step_checkpoint_and_export_match_sequential(tmp_path, sampled_batch_small):
    seq, grp = learner_pair()
    assert grp.spec.experts.name == "TorchGroupedMLP" and seq.spec.experts.name == "SequentialMLP"
    batch = sampled_batch_small
    m_seq, m_grp = seq.train_step(batch), grp.train_step(batch)
    assert m_seq["learner/grad_norm"] > 0
    for key, value in m_seq.items():
        if key not in TIMINGS:
            assert m_grp[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    e_seq, e_grp = seq.export_weights(), grp.export_weights()
    assert list(e_grp) == list(e_seq)
    for k, v in e_seq.items():  # after one AdamW step: still the same weights
        torch.testing.assert_close(e_grp[k], v, atol=1e-6, rtol=1e-5)
    seq.save_checkpoint(str(tmp_path / "seq.pt"))
    with pytest.raises(LearnerError, match=r"resume with learner\.experts=sequential"):
        MegatronLearner(LearnerConfig(model=SMALL, micro_batch_size=4, experts="grouped_mm")).load_checkpoint(
            str(tmp_path / "seq.pt")
        )
    grp.save_checkpoint(str(tmp_path / "grp.pt"))
    saved = torch.load(tmp_path / "grp.pt", weights_only=False)
    assert list(saved["model"]) == [k for k in seq.model.state_dict() if not k.endswith("_extra_state")]
    resumed = MegatronLearner(LearnerConfig(model=SMALL, micro_batch_size=4, experts="grouped_mm"))
    resumed.load_checkpoint(str(tmp_path / "grp.pt"))
    assert all(torch.equal(resumed.export_weights()[k], v) for k, v in e_grp.items())
    m_next, m_resumed = grp.train_step(batch), resumed.train_step(batch)
    for key, value in m_next.items():  # the optimizer state came back too: the next step is the same
        if key not in TIMINGS:
            assert m_resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-8), key


def test_router_replay_drives_the_grouped_experts(sampled_batch_small):
    """Replayed routes (not the routers' own) pick the experts, identically for both modules."""
    seq, grp = learner_pair()
    tokens = sampled_batch_small.tokens_B_T
    own = grp.route(tokens)
    assert torch.equal(own, seq.route(tokens))
    gen = torch.Generator().manual_seed(7)
    # other experts than the routers pick: a random distinct pair per token
    replayed = torch.rand(*own.shape[:-1], SMALL.num_experts, generator=gen).topk(2, dim=-1).indices
    assert not torch.equal(replayed.sort(-1).values, own.sort(-1).values)
    lp_seq, lp_grp = seq.logprobs(tokens, replayed), grp.logprobs(tokens, replayed)
    torch.testing.assert_close(lp_grp, lp_seq, **FP32_TOLERANCE)
    assert not torch.allclose(lp_grp, grp.logprobs(tokens), atol=1e-4)  # the replay changed the experts used


# -- expert parallelism --------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_expert_parallel_over_gloo_matches_sequential(tmp_path):
    """EP=2, 2 gloo processes: each rank's 4 of 8 experts, the allgather dispatcher's exchange."""
    import grouped_experts_worker as worker

    from labrl.harness.models.parallel_gather import gather_model_parallel_shards

    results = spawn_ranks(worker.main, (str(tmp_path),), tmp_path)
    for r in results:
        seq, grp = r["SequentialMLP"], r["TorchGroupedMLP"]
        assert (seq["type"], grp["type"]) == ("SequentialMLP", "TorchGroupedMLP")
        assert grp["state_keys"] == seq["state_keys"]
        assert grp["allreduce"] == seq["allreduce"] == [False, False]  # expert-parallel weights
        assert len(grp["expert_grads"]) == 2 * worker.CFG.num_experts // 2  # 4 local experts, fc1 + fc2
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(grp[key], seq[key], **FP32_TOLERANCE)
        for name, g in seq["expert_grads"].items():
            assert float(g.abs().sum()) > 0, name  # tokens from both ranks reach every expert
            torch.testing.assert_close(grp["expert_grads"][name], g, **FP32_TOLERANCE)
    # the expert-parallel gather (what export_weights does) sees 8 experts under the same names
    prefix = "decoder.layers.0.mlp."
    shards = {
        (0, e): {prefix + k: v for k, v in results[e]["TorchGroupedMLP"]["state"].items()} for e in range(2)
    }
    full = gather_model_parallel_shards(shards, tp=1, ep=2, num_experts=worker.CFG.num_experts)
    assert sorted(k for k in full if ".local_experts." in k) == sorted(
        f"{prefix}experts.local_experts.{e}.linear_fc{i}.weight" for e in range(8) for i in (1, 2)
    )
