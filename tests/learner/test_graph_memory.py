"""Kept loss-forward graphs (learners.graph_memory): what they hold, when one more fits, and that none leaks."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from labrl.harness.learners import LearnerConfig, MegatronLearner, graph_memory
from labrl.harness.learners.graph_memory import (
    GraphBudget,
    SavedBytes,
    gradient_bytes,
    host_free_bytes,
    storages,
)
from labrl.harness.objectives import M2PO, TIS, ObjectiveConfig

M2PO_TIGHT = ObjectiveConfig(corrections=[TIS(c=2.0), M2PO(tau=1e-7)])
MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


# -- what a graph holds --------------------------------------------------------------


def test_saved_bytes_counts_each_saved_storage_once_and_leaves_the_parameters_out():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with SavedBytes(storages([w])) as saved:
        h = x @ w  # saves x (for w's gradient) and w (excluded)
        e = h.exp()  # saves its output
        y = torch.log_softmax(e, dim=-1)  # saves its output
        z = y[:, :8] * y[:, :8]  # saves a view of y twice: y's storage, counted already
    assert saved.bytes == 3 * 32 * 64 * 4
    with_hooks = torch.autograd.grad(z.sum(), w)[0]
    plain = torch.autograd.grad((torch.log_softmax((x @ w).exp(), dim=-1)[:, :8] ** 2).sum(), w)[0]
    assert torch.equal(with_hooks, plain)  # the hooks change nothing that is saved


def test_saved_bytes_sees_nothing_under_no_grad():
    w = torch.randn(16, 16, requires_grad=True)
    with torch.no_grad(), SavedBytes(storages([w])) as saved:
        (torch.randn(4, 16) @ w).exp()
    assert saved.bytes == 0


def test_gradient_bytes_counts_an_fp32_master_copy():
    params = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16)]
    assert gradient_bytes(params, master=False) == 22 * 2
    assert gradient_bytes(params, master=True) == 22 * (2 + 4)
    assert gradient_bytes([torch.zeros(5)], master=False) == 20


# -- when one more fits -----------------------------------------------------------------


def test_the_first_graph_is_always_kept_and_the_next_while_it_fits():
    budget = GraphBudget(free_bytes=10_000, fraction=0.5, gradient_bytes=1_000)  # limit 5,000
    assert budget.admits(10_000)  # nothing measured yet
    budget.record(100, saved_bytes=1_000)  # 10 bytes a token
    assert budget.estimate(100) == 1_000
    # kept + next + gradients + the first backward's transients (the largest graph)
    assert budget.admits(100)  # 1,000 + 1,000 + 1,000 + 1,000 = 4,000
    budget.record(100, saved_bytes=1_000)
    assert budget.admits(100)  # 5,000: the limit itself fits
    budget.record(100, saved_bytes=1_000)
    assert not budget.admits(100)  # 6,000
    assert not budget.admits(1)  # 3,000 + 10 + 1,000 + 1,000: the backward of the largest kept graph


@pytest.mark.parametrize(
    ("kept", "next_tokens", "fits"),
    [
        (0, 10_000, True),  # first: always
        (1, 100, True),  # 1,000 + 1,000 + 1,000 + 1,000 = 4,000
        (1, 200, True),  # 1,000 + 2,000 + 1,000 + 2,000 = 6,000 = the limit
        (1, 201, False),  # 1,000 + 2,010 + 1,000 + 2,010 > 6,000
        (2, 100, True),  # 2,000 + 1,000 + 1,000 + 1,000 = 5,000
        (3, 100, True),  # 3,000 + 1,000 + 1,000 + 1,000 = 6,000
        (4, 100, False),  # 7,000
    ],
)
def test_the_budget_rule_at_its_boundary(kept, next_tokens, fits):
    budget = GraphBudget(free_bytes=12_000, fraction=0.5, gradient_bytes=1_000)  # limit 6,000
    for _ in range(kept):
        budget.record(100, saved_bytes=1_000)
    assert budget.admits(next_tokens) is fits


def test_the_estimate_takes_the_largest_rate_and_the_backward_the_largest_graph():
    budget = GraphBudget(free_bytes=100_000, fraction=0.5, gradient_bytes=0)
    budget.record(100, saved_bytes=500)  # 5 a token
    budget.record(10, saved_bytes=200)  # 20 a token: a short micro-batch with fixed costs
    assert budget.estimate(100) == 2_000
    assert budget.largest == 500 and budget.kept_bytes == 700


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_the_budget_refuses_a_fraction_outside_zero_one(fraction):
    with pytest.raises(ValueError, match="fraction must be in"):
        GraphBudget(free_bytes=1, fraction=fraction, gradient_bytes=0)


@pytest.mark.parametrize("value", [1.0, -0.1, 2])
def test_the_config_refuses_a_fraction_outside_zero_one(value):
    with pytest.raises(ValueError, match="graph_memory_fraction"):
        LearnerConfig(graph_memory_fraction=value)


# -- free memory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("meminfo", "limit", "current", "want"),
    [
        (MEMINFO, None, None, 20_000_000 * 1024),
        (MEMINFO, "max\n", "123\n", 20_000_000 * 1024),  # no cgroup limit
        (MEMINFO, "8589934592\n", "4294967296\n", 4 * 2**30),  # the cgroup leaves less
        (MEMINFO, "8589934592\n", "9000000000\n", 0),  # over its limit already
        (MEMINFO, "64000000000000\n", "0\n", 20_000_000 * 1024),
    ],
)
def test_host_free_bytes_is_the_smaller_of_meminfo_and_the_cgroup(meminfo, limit, current, want):
    assert host_free_bytes(meminfo, limit, current) == want


def test_host_free_bytes_without_meminfo_reads_the_free_pages(monkeypatch):
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(graph_memory.os, "sysconf", pages.__getitem__)
    assert host_free_bytes(None, None, None) == 4_096_000
    assert host_free_bytes("MemTotal: 1 kB\n", "max", "1") == 4_096_000


def test_free_memory_on_cuda_adds_what_the_caching_allocator_holds_unused(monkeypatch):
    fake = {"mem_get_info": lambda device: (5_000, 80_000), "memory_reserved": lambda device: 3_000}
    fake["memory_allocated"] = lambda device: 1_000
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    assert graph_memory.free_memory_bytes(torch.device("cuda:0")) == 5_000 + 2_000


def test_free_memory_on_the_host_reads_this_machine():
    free = graph_memory.free_memory_bytes(torch.device("cpu"))
    assert 0 < free <= host_free_bytes(graph_memory._read(graph_memory.MEMINFO), None, None)


# -- the learner: graphs measured, freed, never leaked -----------------------------------------------


def _learner_and_batch(h, **kw):
    learner = MegatronLearner(LearnerConfig(micro_batch_size=2, objective=M2PO_TIGHT, **kw))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=61)
    return learner, batch


def test_the_learner_measures_each_kept_graph(h, monkeypatch):
    recorded = []
    real = GraphBudget.record

    def record(self, tokens, saved_bytes):
        recorded.append((tokens, saved_bytes))
        real(self, tokens, saved_bytes)

    monkeypatch.setattr(GraphBudget, "record", record)
    learner, batch = _learner_and_batch(h)
    m = learner.train_step(batch)
    assert m["learner/kept_graphs"] == 2.0 and len(recorded) == 2
    vocab = learner.config.model.vocab_size
    for tokens, saved in recorded:
        # at least the fp32 log-softmax over the vocabulary the loss reads, less than a KB a token per
        # vocabulary entry (the tiny model's activations are small beside it)
        assert tokens * vocab * 4 * 0.9 <= saved <= tokens * vocab * 1024


def _alive_beyond_module_state(saved: list[weakref.ref], learner: MegatronLearner) -> list[tuple]:
    """Saved tensors still alive, less those a module or its helper objects hold as state (megatron's token
    dispatcher keeps its last permutation for the next unpermute, on any path)."""
    held = set()
    for m in learner.model.modules():
        for v in vars(m).values():
            helper = not isinstance(v, torch.nn.Module) and hasattr(v, "__dict__")
            for t in vars(v).values() if helper else [v]:
                if isinstance(t, torch.Tensor):
                    held.add(id(t))
    alive = [r() for r in saved]
    return [(tuple(t.shape), t.dtype) for t in alive if t is not None and id(t) not in held]


def _record_saved(monkeypatch, learner: MegatronLearner) -> list[weakref.ref]:
    """Weak references to every non-parameter tensor the kept forwards save."""
    parameters = {p.untyped_storage().data_ptr() for p in learner.model.parameters()}
    saved: list[weakref.ref] = []
    real_pack = SavedBytes._pack

    def pack(self, t):
        if t.untyped_storage().data_ptr() not in parameters:
            saved.append(weakref.ref(t))
        return real_pack(self, t)

    monkeypatch.setattr(SavedBytes, "_pack", pack)
    return saved


def test_the_backward_frees_every_kept_graph(h, monkeypatch):
    # a branch of the forward that the loss does not reach would keep its saved tensors past the backward
    learner, batch = _learner_and_batch(h)
    saved = _record_saved(monkeypatch, learner)
    gc.disable()
    try:
        m = learner.train_step(batch)
        alive = _alive_beyond_module_state(saved, learner)
    finally:
        gc.enable()
    assert m["learner/kept_graphs"] == 2.0 and len(saved) > 50
    assert not alive, alive


def test_a_kept_step_leaves_nothing_for_the_collector(h):
    learner, batch = _learner_and_batch(h)
    learner.train_step(batch)  # warm: lazily built caches are not garbage
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free stays in gc.garbage
    try:
        m = learner.train_step(batch)
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert m["learner/kept_graphs"] == 2.0
    assert garbage == []


@pytest.mark.parametrize("nan_call", [1, 2], ids=["first-micro-batch", "last-micro-batch"])
def test_a_nan_in_a_kept_forward_skips_the_batch_and_frees_every_graph(h, nan_call, monkeypatch, caplog):
    learner, batch = _learner_and_batch(h, max_consecutive_skips=2)
    before = learner.export_weights()
    saved = _record_saved(monkeypatch, learner)
    restore = h.nan_on_call(learner, nan_call)
    gc.disable()  # freed by reference counting, not by a collection that may or may not come
    try:
        with caplog.at_level(logging.WARNING, logger="labrl.harness.learners.megatron"):
            m = learner.train_step(batch)
        alive = _alive_beyond_module_state(saved, learner)
    finally:
        gc.enable()
    assert saved and not alive, alive
    (skip,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "non-finite proximal log-probs on loss-mask tokens: batch skipped" in skip
    assert m["learner/skipped_steps"] == 1.0 and m["learner/optimizer_steps"] == 0.0
    assert learner.version == 0 and not learner.optimizer.state
    assert all(p.grad is None for p in learner.model.parameters())  # no backward ran
    after = learner.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    restore()
    m = learner.train_step(batch)
    assert m["learner/skipped_steps"] == 0.0 and m["learner/kept_graphs"] == 2.0 and learner.version == 1


# -- model-parallel ranks agree ------------------------------------------------------------------


def test_without_a_process_group_a_rank_decides_alone():
    assert graph_memory.agreed(True, torch.device("cpu")) is True
    assert graph_memory.agreed(False, torch.device("cpu")) is False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("refusing", [(), (1,), (0, 1)], ids=["both-keep", "one-refuses", "both-refuse"])
def test_ranks_keep_a_graph_only_if_every_rank_may(tmp_path, refusing):
    """A rank that ran a micro-batch's backward while another ran its forward would pair their collectives
    wrongly: one rank's refusal is every rank's."""
    import graph_agreement_worker as worker
    from spawn_ranks import spawn_ranks

    results = spawn_ranks(worker.main, (str(tmp_path), refusing), tmp_path)
    assert [r["agreed"] for r in results] == [[not refusing, True]] * 2
