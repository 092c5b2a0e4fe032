"""Optional sampler abilities are declared protocols, checked with isinstance (not getattr)."""

from __future__ import annotations

from pipeline_fakes import BigramSampler

from labrl.harness.pipeline.overlong import BudgetForcingSampler
from labrl.harness.samplers.local import LocalSampler
from labrl.harness.samplers.sglang.sampler import SGLangSampler
from labrl.harness.types import Closeable, ReportsSamplerStats


class ClosingSampler(BigramSampler):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


async def test_budget_forcing_passes_stats_and_close_to_the_sampler_it_wraps():
    inner = ClosingSampler()
    inner.stats["busy_s"] = 2.5
    wrapped = BudgetForcingSampler(inner, [1], answer_tokens=2)
    assert isinstance(wrapped, ReportsSamplerStats) and wrapped.stats["busy_s"] == 2.5
    assert isinstance(wrapped, Closeable)
    await wrapped.close()
    assert inner.closed == 1


async def test_a_sampler_without_the_abilities_is_wrapped_safely():
    plain = BigramSampler()
    del plain.stats
    assert not isinstance(plain, ReportsSamplerStats) and not isinstance(plain, Closeable)
    wrapped = BudgetForcingSampler(plain, [1], answer_tokens=2)
    assert dict(wrapped.stats) == {}
    await wrapped.close()  # nothing to release: a no-op, not an AttributeError


def test_the_shipped_samplers_declare_what_they_can_release():
    # SGLangSampler holds an HTTP client the run closes; LocalSampler holds nothing to release
    assert issubclass(SGLangSampler, Closeable) and issubclass(BudgetForcingSampler, Closeable)
    assert not issubclass(LocalSampler, Closeable)
