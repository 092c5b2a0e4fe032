"""The label-free reward ranks the true phase set above hard wrong sets (figure in benchmarks/README.md)."""

from __future__ import annotations

import pytest

from labrl.envs.xrd.ranking import decoy, ranking_study
from labrl.verifiers.xrd.library import load_library

SEEDS = range(40)


def test_decoy_shares_elements_and_is_not_identical():
    lib = load_library()
    d = decoy(lib.get("FeS2_205"), {"FeS2_205"})
    assert d.id != "FeS2_1"  # pyrite in a P1 setting: same pattern, excluded
    assert set(d.elements) & {"Fe", "S"}


@pytest.mark.slow
def test_label_free_ranks_true_set_first_on_95_percent():
    fraction, cases = ranking_study(SEEDS)
    assert len(cases) == 40
    assert fraction >= 0.95, [c for c in cases if not c.passed]
