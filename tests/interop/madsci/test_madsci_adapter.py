"""labrl's MADSci lab adapter against a real ``madsci-node-module`` node on localhost.

The node (``counting_node.py``) appends ``start S`` / ``end S`` to a ledger for
each run of ``measure(sample=S)``: a sample's ``start`` lines count its runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("madsci.node_module")

import asyncio
from pathlib import Path
from typing import Any

import httpx

from labrl.errors import LabRejectedError
from labrl.lab_adapters import JobState, Journal, JournaledLab, JournaledLabConfig
from labrl.lab_adapters.madsci import MadsciNodeAdapter, MadsciNodeConfig

FAST = JournaledLabConfig(use_feed=False, wait_timeout_s=60.0, submit_deadline_s=60.0, backoff_max_s=0.5)


def measure(sample: str, seconds: float = 0.2) -> dict:
    return {"action": "measure", "args": {"sample": sample, "seconds": seconds}}


def open_lab(node: Any, path: Path) -> tuple[JournaledLab, MadsciNodeAdapter, Journal]:
    journal = Journal(path)
    config = MadsciNodeConfig(node_url=node.url, poll_first_s=0.1, poll_max_s=0.5, backoff_max_s=0.5)
    adapter = MadsciNodeAdapter(config, journal)
    return JournaledLab(adapter, journal, FAST), adapter, journal


async def close_lab(lab: JournaledLab, adapter: MadsciNodeAdapter, journal: Journal) -> None:
    await lab.aclose()
    await adapter.aclose()
    await journal.close()


def runs_of(ledger: Path, sample: str) -> tuple[int, int]:
    """(times ``measure(sample)`` began, times it finished) on the node."""
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    return lines.count(f"start {sample}"), lines.count(f"end {sample}")


async def wait_until_started(ledger: Path, sample: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if runs_of(ledger, sample)[0]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{sample} never started on the node")


async def test_experiments_run_once_and_a_repeated_key_replays(shared_counting_node, tmp_path):
    node, ledger = shared_counting_node
    lab, adapter, journal = open_lab(node, tmp_path / "journal.sqlite")
    try:
        samples = ["alpha", "beta-7", "gamma-long"]
        outcomes = await asyncio.gather(*(lab.run(measure(s), f"exp/{s}") for s in samples))
        for sample, outcome in zip(samples, outcomes, strict=True):
            assert outcome.fresh and outcome.status.state is JobState.COMPLETED
            assert outcome.status.result == {"sample": sample, "reading": len(sample) * 1.5}
            assert outcome.status.job_id.startswith("measure/")
        again = await lab.run(measure("alpha"), "exp/alpha")
        assert not again.fresh and again.status.result == outcomes[0].status.result
        # the adapter alone (no JournaledLab) also answers the journaled action for a used key
        direct = await adapter.submit_status(measure("beta-7"), "exp/beta-7")
        assert direct.job_id == outcomes[1].status.job_id and direct.state is JobState.COMPLETED
        assert (await adapter.find("exp/gamma-long")).result == outcomes[2].status.result
        assert await adapter.find("exp/never") is None
        assert [runs_of(ledger, s) for s in samples] == [(1, 1)] * 3
    finally:
        await close_lab(lab, adapter, journal)


async def test_failed_action_and_refused_request(shared_counting_node, tmp_path):
    node, _ = shared_counting_node
    lab, adapter, journal = open_lab(node, tmp_path / "journal.sqlite")
    try:
        jammed = await lab.run({"action": "jam", "args": {"sample": "s1"}}, "exp/jam")
        assert jammed.status.state is JobState.FAILED
        assert "instrument jammed on s1" in jammed.status.error
        with pytest.raises(LabRejectedError, match="422"):  # the action's signature needs "seconds"
            await lab.run({"action": "measure", "args": {"sample": "x"}}, "exp/no-seconds")
        assert (await journal.get("exp/no-seconds")).state == "rejected"
        with pytest.raises(LabRejectedError, match='"action"'):
            await lab.run({"kind": "echo"}, "exp/not-madsci")
    finally:
        await close_lab(lab, adapter, journal)


async def test_an_experiment_offered_to_a_busy_node_waits_its_turn_and_runs_once(
    shared_counting_node, tmp_path
):
    """The node runs one action at a time and drops a start it gets while busy (``not_ready``);
    the adapter offers the experiment again under a new action id until the node takes it."""
    node, ledger = shared_counting_node
    lab, adapter, journal = open_lab(node, tmp_path / "journal.sqlite")
    try:
        first = asyncio.ensure_future(lab.run(measure("busy-first", seconds=2.0), "exp/busy-first"))
        await wait_until_started(ledger, "busy-first")
        second = await lab.run(measure("busy-second"), "exp/busy-second")
        assert second.status.state is JobState.COMPLETED
        assert second.status.result == {"sample": "busy-second", "reading": 16.5}
        assert (await first).status.state is JobState.COMPLETED
        assert runs_of(ledger, "busy-first") == (1, 1) and runs_of(ledger, "busy-second") == (1, 1)
        lines = ledger.read_text().splitlines()
        assert lines.index("end busy-first") < lines.index("start busy-second")
    finally:
        await close_lab(lab, adapter, journal)


async def test_client_restart_mid_action_reattaches_without_rerunning(shared_counting_node, tmp_path):
    node, ledger = shared_counting_node
    path = tmp_path / "journal.sqlite"
    lab, adapter, journal = open_lab(node, path)
    running = asyncio.ensure_future(lab.run(measure("delta", seconds=2.0), "exp/delta"))
    await wait_until_started(ledger, "delta")
    running.cancel()  # the client dies while the node runs the action
    with pytest.raises(asyncio.CancelledError):
        await running
    await close_lab(lab, adapter, journal)

    lab, adapter, journal = open_lab(node, path)
    try:
        outcomes = await lab.resume()
        assert [(o.key, o.status.state, o.fresh) for o in outcomes] == [
            ("exp/delta", JobState.COMPLETED, True)
        ]
        assert outcomes[0].status.result == {"sample": "delta", "reading": 7.5}
        assert lab.stats["resumed"] == 1 and lab.stats["submitted"] == 0
        assert runs_of(ledger, "delta") == (1, 1)
    finally:
        await close_lab(lab, adapter, journal)


async def test_action_created_and_journaled_but_never_started_is_started_once(shared_counting_node, tmp_path):
    """The client died between journaling the action id and starting it: the resume starts it, once."""
    node, ledger = shared_counting_node
    lab, adapter, journal = open_lab(node, tmp_path / "journal.sqlite")
    try:
        request = measure("epsilon")
        await journal.record("exp/epsilon", request)
        async with httpx.AsyncClient(base_url=node.url) as http:
            created = (await http.post("/action/measure", json={"args": request["args"]})).json()
        await journal.attach("exp/epsilon", f"measure/{created['action_id']}")
        assert runs_of(ledger, "epsilon") == (0, 0)

        outcomes = await lab.resume()
        assert [o.status.state for o in outcomes] == [JobState.COMPLETED]
        assert outcomes[0].status.result == {"sample": "epsilon", "reading": 10.5}
        assert runs_of(ledger, "epsilon") == (1, 1)
        assert lab.stats["submitted"] == 0
    finally:
        await close_lab(lab, adapter, journal)


async def test_node_restart_mid_action_loses_nothing_and_runs_nothing_twice(counting_node, tmp_path):
    node, ledger = counting_node
    node.start()
    lab, adapter, journal = open_lab(node, tmp_path / "journal.sqlite")
    try:
        done = await lab.run(measure("before"), "exp/before")
        interrupted = asyncio.ensure_future(lab.run(measure("during", seconds=30.0), "exp/during"))
        await wait_until_started(ledger, "during")
        node.stop(kill=True)  # the node crashes mid-action
        # submitted while the node is down: retried until the node is back
        queued = asyncio.ensure_future(lab.run(measure("after"), "exp/after"))
        await asyncio.sleep(0.5)
        node.start()

        lost, late = await asyncio.gather(interrupted, queued)
        assert lost.status.state is JobState.FAILED and "no longer knows action" in lost.status.error
        assert late.status.state is JobState.COMPLETED and late.status.result["sample"] == "after"
        assert runs_of(ledger, "before") == (1, 1)
        assert runs_of(ledger, "during") == (1, 0)  # interrupted by the crash, never started again
        assert runs_of(ledger, "after") == (1, 1)
        replay = await lab.run(measure("before"), "exp/before")
        assert not replay.fresh and replay.status.result == done.status.result
        counts = await journal.counts()
        assert counts == {"completed": 2, "failed": 1}
    finally:
        await close_lab(lab, adapter, journal)
