"""``learner.objective_kernel: compiled``: the compiled objective trains as the eager one does, in one
graph per micro-batch size; a compilation that fails is raised, not hidden."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig
from labrl.harness.objectives import M2PO, TIS, ObjectiveConfig, _objective


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no earlier test's graphs count against dynamo's recompile limit
    counters.clear()  # and each test counts its own
    yield
    torch._dynamo.reset()


def _config(kernel: str, minibatches: int = 2, corrections: tuple = (M2PO(tau=0.04),)) -> LearnerConfig:
    return LearnerConfig(
        micro_batch_size=3,
        minibatches=minibatches,
        optimizer=OptimizerConfig(lr=1e-3),
        objective=ObjectiveConfig(corrections=list(corrections)),
        objective_kernel=kernel,
    )


# each way the learner gets its proximal log-probs (docs/training.md, "Proximal log-probs")
PATHS = {
    # two optimizer steps a batch: the separate no-grad forward, and the second step sees r != 1
    "separate forward": ({"minibatches": 2}, {"learner/proximal_forward": 1.0, "learner/kept_graphs": 0.0}),
    # one step, M2PO: every loss forward first with its graph kept, prepare, then the backwards
    "kept graphs": ({"minibatches": 1}, {"learner/proximal_forward": 0.0, "learner/kept_graphs": 3.0}),
    # one step, no whole-batch term: each micro-batch's own forward and prepare_rows
    "one forward": (
        {"minibatches": 1, "corrections": (TIS(),)},
        {"learner/proximal_forward": 0.0, "learner/kept_graphs": 0.0},
    ),
}


@pytest.mark.parametrize("path", PATHS)
def test_compiled_trains_as_eager_does(h, path):
    assert LearnerConfig().objective_kernel == "eager"
    kwargs, want = PATHS[path]
    eager, compiled = (
        MegatronLearner(_config("eager", **kwargs)),
        MegatronLearner(_config("compiled", **kwargs)),
    )
    assert not eager.compiled_objective and compiled.compiled_objective
    for seed in (5, 6):
        batch = h.sampled_batch(h.make_sampler(eager, "fp32"), n=7, max_new=10, seed=seed)
        m_eager, m_compiled = eager.train_step(batch), compiled.train_step(batch)
        assert {k: m_eager[k] for k in want} == want == {k: m_compiled[k] for k in want}
        for k in ("loss/total", "policy/ratio_mean", "policy/clip_frac", "learner/grad_norm"):
            assert m_compiled[k] == pytest.approx(m_eager[k], rel=1e-4, abs=1e-6), k
    w_eager, w_compiled = eager.export_weights(), compiled.export_weights()
    for k in w_eager:
        torch.testing.assert_close(w_compiled[k], w_eager[k], rtol=1e-4, atol=1e-6)
    # compiled indeed (past dynamo's recompile limit it would run eager in silence): the micro-batches
    # of 3 rows and the last of 1 (sizes 1 are specialised), nothing per batch
    assert counters["stats"]["unique_graphs"] == 2


class _CompileFailed(TorchDynamoException):
    """What dynamo or inductor raises when a compilation fails (their errors derive from it)."""


def _failing_compile(monkeypatch) -> None:
    def compiled_loss_terms():
        def fail(*args, **kwargs):
            raise _CompileFailed("inductor: no C compiler")

        return fail

    monkeypatch.setattr(_objective, "compiled_loss_terms", compiled_loss_terms)


def test_a_compilation_that_fails_is_raised(h, monkeypatch):
    _failing_compile(monkeypatch)
    learner = MegatronLearner(_config("compiled"))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=7, max_new=10, seed=5)
    with pytest.raises(_CompileFailed, match="no C compiler"):
        learner.train_step(batch)


def test_an_unknown_objective_kernel_is_a_config_error():
    with pytest.raises(ValueError, match="objective_kernel"):
        LearnerConfig(objective_kernel="auto")


def test_under_a_dispatch_mode_the_compiled_objective_runs_eager(h):
    """Dynamo compiles nothing under a ``TorchDispatchMode`` (a FLOP counter, the op counter of
    benchmarks/step_profile.py): the learner runs the same terms eager there instead of failing."""
    from torch.utils.flop_counter import FlopCounterMode

    eager, compiled = MegatronLearner(_config("eager")), MegatronLearner(_config("compiled"))
    batch = h.sampled_batch(h.make_sampler(eager, "fp32"), n=7, max_new=10, seed=5)
    with FlopCounterMode(display=False):
        m_compiled = compiled.train_step(batch)
    m_eager = eager.train_step(batch)
    # approx: FlopCounterMode itself runs some of the model's ops another way (to round-off)
    assert m_compiled["loss/total"] == pytest.approx(m_eager["loss/total"], rel=1e-5)
    assert compiled.compiled_objective  # still chosen: only that call ran eager
    assert counters["stats"]["unique_graphs"] == 0
