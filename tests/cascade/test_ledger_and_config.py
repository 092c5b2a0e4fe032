"""The ``cascade:`` section's validation and the budget ledger: refusal beyond a budget, one charge per key."""

from __future__ import annotations

import pytest

from labrl.envs import make
from labrl.envs.cascade import CascadeSection, CostUnit, Latency, MemoryLedger, SqliteLedger, Stage
from labrl.errors import BudgetExhaustedError, ConfigError
from labrl.harness.config import build_run_config

DFT = Stage(name="dft", cost_unit=CostUnit.GPU_H, cost=0.5, latency=Latency(median_s=60))


@pytest.mark.parametrize(
    "section",
    [
        {"audit_probabilty": 0.1},  # typo
        {"audit_probability": 0.0},  # no audit: the correction is impossible
        {"audit_probability": 1.5},
        {"budgets": {"dft": {"limit": -1, "unit": "gpu_h"}}},
        {"budgets": {"dft": {"limit": 1e7, "unit": "gpu_h"}}},  # more GPU-hours than anyone has
        {"budgets": {"dft": {"limit": 1, "unit": "gpu_hours"}}},
        {"budgets": {"dft": {"limit": 1, "unit": "gpu_h", "extra": 1}}},
        {"seed": -1},
    ],
)
def test_bad_sections_are_refused(section):
    with pytest.raises(ValueError):
        CascadeSection.model_validate(section)


def test_budgets_are_checked_against_the_env_stages():
    with pytest.raises(ConfigError, match=r"no stage 'truht'.*did you mean 'truth'"):
        make("synthetic/cascade-v0", cascade={"budgets": {"truht": {"limit": 1, "unit": "gpu_h"}}})
    with pytest.raises(ConfigError, match="unit cpu_s, but stage 'truth' is charged in gpu_h"):
        make("synthetic/cascade-v0", cascade={"budgets": {"truth": {"limit": 1, "unit": "cpu_s"}}})
    with pytest.raises(ConfigError, match="invalid cascade section"):
        make("synthetic/cascade-v0", cascade={"audit_probability": 2})


def test_the_run_config_owns_a_cascade_section():
    base = {"env": {"id": "synthetic/cascade-v0"}}
    cfg = build_run_config({**base, "cascade": {"audit_probability": 0.25}})
    assert cfg.cascade == CascadeSection(audit_probability=0.25)
    with pytest.raises(ConfigError, match="cascade"):
        build_run_config({**base, "cascade": {"audit_probabilty": 0.25}})


@pytest.fixture(params=["memory", "sqlite"])
def open_ledger(request, tmp_path):
    def opener(limit: float | None = None):
        budgets = {} if limit is None else {"dft": {"limit": limit, "unit": "gpu_h"}}
        section = CascadeSection.model_validate({"budgets": budgets})
        if request.param == "memory":
            return MemoryLedger(section.budgets)
        return SqliteLedger(tmp_path / "ledger.sqlite", section.budgets)

    return opener


async def test_the_ledger_charges_each_key_once_and_refuses_beyond_the_budget(open_ledger):
    ledger = open_ledger(limit=1.2)
    try:
        first = await ledger.pay("a", DFT)
        assert (first.charged, first.value) == (0.5, None)
        await ledger.settle("a", 0.8, 1.0)
        again = await ledger.pay("a", DFT)
        assert (again.charged, again.value) == (0.0, 0.8)
        assert (await ledger.pay("b", DFT)).charged == 0.5
        with pytest.raises(BudgetExhaustedError, match=r"1 of its 1\.2 gpu_h budget is spent"):
            await ledger.pay("c", DFT)
        assert await ledger.spent() == {"dft": 1.0}  # the refused call charged nothing
        assert (await ledger.pay("b", DFT)).charged == 0.0  # a paid key is still answered
    finally:
        await ledger.close()


async def test_a_persisted_ledger_survives_a_crash_without_a_second_charge(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger = SqliteLedger(path, {})
    await ledger.pay("settled", DFT)
    await ledger.settle("settled", 0.3, 2.0)
    await ledger.pay("running", DFT)  # the process dies while the stage runs
    await ledger.close()

    reopened = SqliteLedger(path, {})
    try:
        settled = await reopened.pay("settled", DFT)
        running = await reopened.pay("running", DFT)
        assert (settled.charged, settled.value) == (0.0, 0.3)  # answered from the ledger
        assert (running.charged, running.value) == (0.0, None)  # run again, not charged again
        assert await reopened.spent() == {"dft": 1.0}
    finally:
        await reopened.close()


def test_a_file_that_is_not_a_ledger_is_a_config_error(tmp_path):
    path = tmp_path / "ledger.sqlite"
    path.write_text("not a database")
    with pytest.raises(ConfigError, match="not a usable ledger"):
        SqliteLedger(path, {})
