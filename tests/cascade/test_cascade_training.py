"""The synthetic cascade trained by the orchestrator: group rules, the episode record, the budget."""

from __future__ import annotations

import pytest
from cascade_fakes import cascade_orchestrator

from labrl.envs.cascade import CascadeSection
from labrl.envs.cascade.env import shared_ledger

AUDIT = {"audit_probability": 0.2}


@pytest.mark.parametrize("rule", [{"top_k": 2}, {"informative_z": 2.0}], ids=["top_k", "informative"])
async def test_a_group_ruled_cascade_trains_two_steps(tmp_path, rule):
    orch, records, evals = cascade_orchestrator(tmp_path, cascade=AUDIT, **rule)
    await orch.run()
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["errors/env_error_total"] == records[-1]["errors/verifier_failed_total"] == 0
    assert [e["step"] for e in evals] == [0, 2] and all(e["errors/env_error_frac"] == 0 for e in evals)
    spent = await shared_ledger(CascadeSection(**AUDIT)).spent()  # the run's ledger, on this loop
    assert spent["proxy"] >= 0.01 * 2 * 2 * 4  # every episode of the two trained batches was screened
    assert 0 < spent["truth"] < spent["proxy"] / 0.01 * 0.001  # the truth paid for some, not all
