"""The proximal forward: dropped where the objective allows (learners.proximal), same step as with it.

Under a whole-batch term (M2PO) with several micro-batches the loss forwards run first and keep their
graphs while memory allows (learners.graph_memory): the same step, without the no-grad forward."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from labrl.harness import objectives
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig, graph_memory
from labrl.harness.learners.proximal import proximal_forward
from labrl.harness.objectives import M2PO, OPSM, TIS, IcePop, ObjectiveConfig

TIS_ONLY = ObjectiveConfig(corrections=[TIS(c=2.0)])  # the default objective: per-token terms only
ROW_LOCAL = ObjectiveConfig(
    loss="ppo", corrections=[TIS(c=1.2), IcePop(low=0.999, high=1.001), OPSM(delta=1e-4)]
)
M2PO_TIGHT = ObjectiveConfig(corrections=[TIS(c=2.0), M2PO(tau=1e-7)])  # masks on the bf16 mismatch
M2PO_KL = ObjectiveConfig(
    loss="cispo", corrections=[M2PO(tau=1e-7)], kl_coef=0.1
)  # the quickstart's, tighter


@pytest.mark.parametrize(
    ("choice", "steps", "micro", "terms", "fraction", "separate", "keep"),
    [
        ("auto", 1, 1, (), 0.5, False, False),
        (
            "auto",
            1,
            1,
            ("m2po",),
            0.5,
            False,
            False,
        ),  # one micro-batch: the whole batch is in the one forward
        ("auto", 1, 3, (), 0.5, False, False),
        ("auto", 1, 3, ("m2po",), 0.5, False, True),  # loss forwards first, graphs kept, backward after
        ("auto", 1, 3, ("m2po",), 0.0, True, False),  # no graph may be kept: the no-grad forward first
        ("auto", 1, 3, (), 0.0, False, False),  # the fraction matters only under a whole-batch term
        ("auto", 2, 1, (), 0.5, True, False),  # several optimizer steps: pi_prox is the batch start
        ("auto", 3, 4, ("m2po",), 0.5, True, False),
        ("separate", 1, 1, (), 0.5, True, False),
        ("separate", 1, 3, ("m2po",), 0.5, True, False),
    ],
)
def test_the_decision_per_case(choice, steps, micro, terms, fraction, separate, keep):
    got = proximal_forward(
        choice=choice,
        optimizer_steps=steps,
        micro_batches=micro,
        whole_batch_terms=terms,
        graph_memory_fraction=fraction,
    )
    assert (got.separate, got.keep_graphs) == (separate, keep), got.reason
    if terms and steps == 1 and choice == "auto" and micro > 1:
        assert "m2po" in got.reason


def count_forwards(learner: MegatronLearner) -> dict[str, int]:
    """Calls of the policy's and the reference's forward, split by grad mode."""
    counts = {"policy_grad": 0, "policy_no_grad": 0, "reference": 0}

    def policy(module, args):
        counts["policy_grad" if torch.is_grad_enabled() else "policy_no_grad"] += 1

    def reference(module, args):
        counts["reference"] += 1

    learner.model.register_forward_pre_hook(policy)
    if learner.reference_model is not None:
        learner.reference_model.register_forward_pre_hook(reference)
    return counts


@pytest.mark.parametrize(
    ("kw", "want", "separate", "kept"),
    [
        ({"micro_batch_size": 8}, {"policy_grad": 1, "policy_no_grad": 0}, 0.0, 0),
        ({"micro_batch_size": 8, "objective": M2PO_TIGHT}, {"policy_grad": 1, "policy_no_grad": 0}, 0.0, 0),
        ({"micro_batch_size": 2}, {"policy_grad": 2, "policy_no_grad": 0}, 0.0, 0),
        ({"micro_batch_size": 2, "objective": M2PO_TIGHT}, {"policy_grad": 2, "policy_no_grad": 0}, 0.0, 2),
        (
            {"micro_batch_size": 2, "objective": M2PO_TIGHT, "graph_memory_fraction": 0.0},
            {"policy_grad": 2, "policy_no_grad": 2},
            1.0,
            0,
        ),
        (
            {"micro_batch_size": 2, "objective": M2PO_KL, "reference": "initial"},
            {"policy_grad": 2, "policy_no_grad": 0, "reference": 2},
            0.0,
            2,
        ),
        ({"micro_batch_size": 8, "minibatches": 2}, {"policy_grad": 2, "policy_no_grad": 1}, 1.0, 0),
        ({"micro_batch_size": 8, "epochs": 2}, {"policy_grad": 2, "policy_no_grad": 1}, 1.0, 0),
        (
            {"micro_batch_size": 8, "proximal_forward": "separate"},
            {"policy_grad": 1, "policy_no_grad": 1},
            1.0,
            0,
        ),
        (
            {"micro_batch_size": 2, "reference": "initial", "objective": ObjectiveConfig(kl_coef=0.1)},
            {"policy_grad": 2, "policy_no_grad": 0, "reference": 2},
            0.0,
            0,
        ),
    ],
    ids=[
        "one-micro",
        "one-micro-m2po",
        "two-micro",
        "two-micro-m2po-kept-graphs",
        "two-micro-m2po-no-graph-memory",
        "two-micro-m2po-kl-kept-graphs",  # the quickstart's objective
        "minibatches",
        "epochs",
        "separate",
        "ref",
    ],
)
def test_forward_count_per_case(h, kw, want, separate, kept):
    learner = MegatronLearner(LearnerConfig(**kw))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=61)
    counts = count_forwards(learner)
    m = learner.train_step(batch)
    assert m["learner/proximal_forward"] == separate
    assert m["learner/kept_graphs"] == float(kept)
    assert counts == {"reference": 0} | want
    assert m["learner/optimizer_steps"] == float(kw.get("minibatches", 1) * kw.get("epochs", 1))


def test_a_graph_that_does_not_fit_gets_the_no_grad_forward(h, monkeypatch):
    """Free memory for the first kept graph only: the second micro-batch's pi_prox comes from a no-grad
    forward and its loss forward runs in the optimizer step, as under the separate forward."""
    monkeypatch.setattr(graph_memory, "free_memory_bytes", lambda device: 0)
    learner = MegatronLearner(LearnerConfig(micro_batch_size=2, objective=M2PO_TIGHT))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=61)
    counts = count_forwards(learner)
    m = learner.train_step(batch)
    assert counts == {"policy_grad": 2, "policy_no_grad": 1, "reference": 0}
    assert (m["learner/kept_graphs"], m["learner/proximal_forward"]) == (1.0, 0.5)


def _step_both_ways(h, **kw) -> tuple[MegatronLearner, MegatronLearner, dict, dict]:
    """One train_step on the same bf16-sampled batch by a learner with and one without the separate forward."""
    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), **kw)
    one = MegatronLearner(cfg)
    two = MegatronLearner(cfg.model_copy(update={"proximal_forward": "separate"}))
    batch = h.sampled_batch(h.make_sampler(one, "bf16"), n=8, max_new=10, seed=71)  # a real mismatch
    return one, two, one.train_step(batch), two.train_step(batch)


@pytest.mark.parametrize(
    ("kw", "acting", "kept"),
    [
        ({"micro_batch_size": 8, "objective": M2PO_TIGHT}, "m2po/masked_frac", 0),
        ({"micro_batch_size": 3, "objective": M2PO_TIGHT}, "m2po/masked_frac", 3),
        (
            {"micro_batch_size": 3, "objective": M2PO_KL, "reference": "initial"},
            "m2po/masked_frac",
            3,
        ),
        ({"micro_batch_size": 3, "objective": ROW_LOCAL}, "icepop/masked_frac", 0),
        (
            {"micro_batch_size": 3, "length_sorted_micro_batches": True, "objective": ROW_LOCAL},
            "icepop/masked_frac",
            0,
        ),
        (
            {"micro_batch_size": 3, "reference": "initial", "objective": ObjectiveConfig(kl_coef=0.1)},
            "learner/reference",  # a wrong reference would show in ref_kl (0 in both at the first step)
            0,
        ),
    ],
    ids=[
        "one-micro-m2po",
        "three-micro-m2po-kept-graphs",
        "three-micro-m2po-kl-kept-graphs",
        "three-micro-row-local",
        "length-sorted",
        "reference-kl",
    ],
)
def test_one_forward_gives_the_two_forward_step(h, kw, acting, kept):
    one, two, m1, m2 = _step_both_ways(h, **kw)
    assert (m1["learner/proximal_forward"], m2["learner/proximal_forward"]) == (0.0, 1.0)
    assert m1["learner/kept_graphs"] == float(kept)  # three micro-batches of 8 rows, M2PO: every graph kept
    assert m1[acting] > 0  # the correction acts, so a wrong pi_prox would show
    # the behaviour-vs-learner mismatch diagnostic stays, from the same pi_prox
    assert m1["mismatch/kl_k3"] > 0 and m1["mismatch/abs_log_ratio_mean"] > 0
    # the time and the path taken, not the step's values
    timing = {"learner/step_s", "learner/tokens_per_s", "learner/proximal_forward"}
    timing |= {"learner/kept_graphs", "learner/kept_graph_bytes"}
    assert set(m1) == set(m2)
    for key in set(m1) - timing:
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    grads = [(p.grad, q.grad) for p, q in zip(one.model.parameters(), two.model.parameters(), strict=True)]
    assert all(a is not None for a, _ in grads)
    for a, b in grads:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    wa, wb = one.export_weights(), two.export_weights()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-8)
    assert one.policy_versions == two.policy_versions


def record_proximal_is_current(monkeypatch) -> list[bool]:
    """The ``proximal_is_current`` flag of every ``policy_loss`` call the learner makes."""
    flags: list[bool] = []
    real = objectives.policy_loss

    def spy(*args, **kw):
        flags.append(kw.get("proximal_is_current", False))
        return real(*args, **kw)

    monkeypatch.setattr(objectives, "policy_loss", spy)
    return flags


@pytest.mark.parametrize(
    ("kw", "free_memory", "want"),
    [
        ({"micro_batch_size": 2}, None, [True, True]),  # pi_prox from each loss forward
        ({"micro_batch_size": 8, "objective": M2PO_TIGHT}, None, [True]),  # one micro-batch, M2PO
        ({"micro_batch_size": 2, "objective": M2PO_TIGHT}, None, [True, True]),  # every graph kept
        ({"micro_batch_size": 2, "objective": M2PO_TIGHT}, 0, [False, False]),  # one of two kept
        ({"micro_batch_size": 2, "proximal_forward": "separate"}, None, [False, False]),
        ({"micro_batch_size": 8, "epochs": 2}, None, [False, False]),  # the second step has r != 1
    ],
    ids=["loss-forward", "one-micro-m2po", "all-kept", "one-kept", "separate", "epochs"],
)
def test_the_ratio_terms_are_skipped_exactly_where_the_proximal_is_the_loss_forward(
    h, monkeypatch, kw, free_memory, want
):
    if free_memory is not None:  # room for the first graph only
        monkeypatch.setattr(graph_memory, "free_memory_bytes", lambda device: free_memory)
    learner = MegatronLearner(LearnerConfig(**kw))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=61)
    flags = record_proximal_is_current(monkeypatch)
    m = learner.train_step(batch)
    assert flags == want
    assert m["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6 if all(want) else 0.5)
    assert "policy/clip_frac" in m and "policy/abs_log_ratio_mean" in m


@pytest.mark.parametrize(
    "kw",
    [
        {"micro_batch_size": 3},  # the default objective (CISPO, TIS), pi_prox from each loss forward
        {
            "micro_batch_size": 3,
            "objective": M2PO_KL,
            "reference": "initial",
        },  # the quickstart's, kept graphs
    ],
    ids=["default", "quickstart-kept-graphs"],
)
def test_skipping_the_ratio_terms_leaves_weights_bit_equal(h, kw):
    """Three steps with the ratio and clip terms skipped and three with them computed (r = 1 on every
    token): the same weights bit for bit, the same metrics."""
    cfg = LearnerConfig(optimizer=OptimizerConfig(lr=1e-3), **kw)
    fast, general = MegatronLearner(cfg), MegatronLearner(cfg)
    general_step = general._optimizer_step
    general._optimizer_step = lambda *a, **k: general_step(*a, **{**k, "proximal_is_current": False})
    sampler = h.make_sampler(fast, "bf16")
    timing = {"learner/step_s", "learner/tokens_per_s"}
    for seed in (71, 72, 73):
        batch = h.sampled_batch(sampler, n=8, max_new=10, seed=seed)
        m_fast, m_general = fast.train_step(batch), general.train_step(batch)
        assert set(m_fast) == set(m_general)
        for key in set(m_fast) - timing:
            assert m_fast[key] == pytest.approx(m_general[key], rel=1e-12, abs=1e-12), key
    wa, wb = fast.export_weights(), general.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert fast.version == general.version == 3


@pytest.mark.parametrize("nan_call", [1, 2], ids=["first-micro-batch", "last-micro-batch"])
def test_nan_in_any_micro_batch_skips_the_batch_without_the_separate_forward(h, nan_call, caplog):
    # the check is counted once every micro-batch's pi_prox is in: a NaN of the first is still caught
    learner = MegatronLearner(LearnerConfig(micro_batch_size=2, max_consecutive_skips=2))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=81)
    before = learner.export_weights()
    counts = count_forwards(learner)
    restore = h.nan_on_call(learner, nan_call)
    with caplog.at_level(logging.WARNING, logger="labrl.harness.learners.megatron"):
        m = learner.train_step(batch)
    assert counts["policy_no_grad"] == 0 and counts["policy_grad"] == 2  # the first micro-batch did backward
    # the cause is named first, with the loss it made non-finite
    (skip,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert re.search(
        r"\): \d+ non-finite proximal log-probs on loss-mask tokens; 1 micro-batches with a "
        r"non-finite loss at step 0: optimizer step skipped",
        skip,
    ), skip
    assert m["learner/skipped_steps"] == 1.0 and m["learner/optimizer_steps"] == 0.0
    assert learner.version == 0 and learner.step == 0 and learner.optimizer_steps == 0
    assert all(p.grad is None for p in learner.model.parameters())  # its gradients were dropped
    assert not learner.optimizer.state
    after = learner.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    restore()
    m = learner.train_step(batch)
    assert m["learner/skipped_steps"] == 0.0 and learner.version == 1 and learner.consecutive_skips == 0
