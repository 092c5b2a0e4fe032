"""The harness's view of a cascade's budgets: admission by predicted spend, a clean stop, metrics and report."""

from __future__ import annotations

import json

import pytest
from cascade_fakes import cascade_orchestrator

from labrl.envs import make
from labrl.envs.cascade import CascadeRecord, CostUnit, StageRecord
from labrl.errors import BudgetExhaustedError
from labrl.harness.metrics import summary_line
from labrl.harness.pipeline import latest_checkpoint
from labrl.harness.pipeline.cascade_budget import MIN_OBSERVED, CascadeBudget
from labrl.harness.report import write_report
from labrl.harness.types import Trajectory

FAST = {"proxy_latency_s": 1e-4, "truth_latency_s": 1e-4}


def _budget(limit: float, truth_cost: float) -> CascadeBudget:
    env = make(
        "synthetic/cascade-v0", **FAST, truth_cost_gpu_h=truth_cost,
        cascade={"budgets": {"truth": {"limit": limit, "unit": "gpu_h"}}},
    )  # fmt: skip
    budget = CascadeBudget.of(env)
    assert budget is not None
    return budget


def _episode(truth_cost: float | None, baseline: float | None = None) -> Trajectory:
    """A finished episode that paid the proxy, and the truth at ``truth_cost`` (None: not reached);
    ``baseline``: the learnt b it was rewarded with."""
    stages = [StageRecord(stage="proxy", value=0.5, cost=0.01, cost_unit=CostUnit.CPU_S, seconds=0.0,
                          run_probability=1.0, passed_rule=True)]  # fmt: skip
    if truth_cost is not None:
        stages.append(StageRecord(stage="truth", value=0.4, cost=truth_cost, cost_unit=CostUnit.GPU_H,
                                  seconds=0.0, run_probability=1.0, passed_rule=True))  # fmt: skip
    record = CascadeRecord(stages=tuple(stages), reward=0.4, declared=("proxy", "truth"), baseline=baseline)
    return Trajectory(
        env_id="synthetic/cascade-v0", task_id="t", group_id="g", tokens_T=[1], loss_mask_T=[1],
        logprobs_T=[0.0], versions_T=[0], reward=0.4, outcome="ok", finish_reason="stop", num_turns=1,
        info={"cascade": record.model_dump(mode="json")},
    )  # fmt: skip


def test_admission_counts_every_episode_in_flight_at_its_predicted_cost():
    budget = _budget(limit=4.0, truth_cost=0.25)
    budget.spent = {"truth": 1.0}
    # before MIN_OBSERVED episodes, c = 0.25 (every episode reaching the truth): (n + 4) * 0.25 <= 3
    assert budget.admits(inflight=8, group_size=4)
    assert not budget.admits(inflight=9, group_size=4)
    budget.observe([_episode(0.25) if i % 4 == 0 else _episode(None) for i in range(MIN_OBSERVED)])
    assert budget.cost_per_episode(budget.stages[1]) == pytest.approx(0.25 * 2 / MIN_OBSERVED)
    # measured c = 0.0625: (n + 4) * 0.0625 <= 3, so up to 44 in flight
    assert budget.admits(inflight=44, group_size=4) and not budget.admits(inflight=45, group_size=4)
    budget.spent = {"truth": 3.8}  # near the end, fewer may run at once, then none
    assert budget.admits(inflight=0, group_size=3) and not budget.admits(inflight=0, group_size=4)
    assert "is predicted to cost 0.25" in str(budget.exhausted_error(group_size=4))


def test_the_step_metrics_report_spend_what_is_left_and_the_pass_rate():
    budget = _budget(limit=4.0, truth_cost=0.25)
    budget.spent = {"proxy": 0.04, "truth": 0.5}
    budget.observe([_episode(0.25), _episode(None), _episode(None), _episode(0.25)])
    metrics = budget.step_metrics()
    assert metrics["cascade/truth/spent"] == 0.5 and metrics["cascade/truth/left"] == 3.5
    assert metrics["cascade/truth/limit"] == 4.0 and "cascade/proxy/left" not in metrics
    assert metrics["cascade/proxy/pass_rate"] == 0.5
    assert budget.step_metrics()["cascade/proxy/pass_rate"] is None  # the window restarts each step
    line = summary_line({"step": 3, **metrics}, total_steps=10)
    assert line.endswith("budget left truth 3.5/4")
    assert "cascade/learnt_baseline_frac" not in metrics  # the plain estimator: nothing to report


def test_the_step_metrics_report_the_share_rewarded_with_a_learnt_baseline():
    env = make("synthetic/cascade-v0", **FAST, cascade={"control_variate": {"kind": "nearest_truths"}})
    budget = CascadeBudget.of(env)
    assert budget is not None
    assert budget.step_metrics()["cascade/learnt_baseline_frac"] is None  # no episode yet
    budget.observe(
        [_episode(None), _episode(None, baseline=0.3), _episode(0.25, baseline=0.6), _episode(None, 0.2)]
    )
    assert budget.step_metrics()["cascade/learnt_baseline_frac"] == 0.75
    assert budget.step_metrics()["cascade/learnt_baseline_frac"] is None  # the window restarts each step


async def test_a_run_with_budget_to_spare_reports_it_per_step_and_in_the_report(tmp_path):
    budgets = {"truth": {"limit": 10.0, "unit": "gpu_h"}}
    orch, records, _ = cascade_orchestrator(tmp_path, cascade={"audit_probability": 0.2, "budgets": budgets})
    await orch.run()
    last = records[-1]
    spent = last["cascade/truth/spent"]  # the final evaluation, after the last record, pays too
    assert 0 < spent <= (await orch.cascade_budget.env.ledger_spent())["truth"]
    assert last["cascade/truth/left"] == pytest.approx(10.0 - spent)
    rates = [r["cascade/proxy/pass_rate"] for r in records if r["cascade/proxy/pass_rate"] is not None]
    assert rates and all(0 <= rate <= 1 for rate in rates)  # None: no episode finished since the last step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report(tmp_path)
    assert f"cascade stage truth: spent {spent:.4g} of 10" in report.summary
    assert (tmp_path / "report" / "cascade_budget.png").is_file()


async def test_a_run_that_exhausts_its_budget_stops_at_admission_checkpointed(tmp_path):
    """A truth budget of 5 calls for a run that wants 16 episodes: admission lets one group of 4 run at
    a time while the declared cost says it fits, then starts none and stops the run; the ledger never
    refuses a charge. (No evaluation: held-out episodes pay the same budget outside admission.)"""
    budgets = {"truth": {"limit": 0.005, "unit": "gpu_h"}}
    orch, records, _ = cascade_orchestrator(
        tmp_path, cascade={"audit_probability": 0.2, "budgets": budgets}, pass_threshold=-10.0, eval_every=0
    )  # every candidate passes: each episode pays the truth
    with pytest.raises(BudgetExhaustedError) as stopped:
        await orch.run()
    message = str(stopped.value)
    assert "a group of 4 episodes is predicted to cost 0.004" in message
    assert "raise cascade.budgets.truth.limit" in message and "rerun the same command to resume" in message
    assert "\n" not in message
    assert (await orch.cascade_budget.env.ledger_spent())["truth"] == pytest.approx(0.004)  # one group
    assert latest_checkpoint(tmp_path) is not None and records == []
