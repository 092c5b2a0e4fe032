"""The mock lab as a MADSci node (``labrl lab serve-madsci-node``), driven by madsci-client's ``RestNodeClient``."""

from __future__ import annotations

import pytest

pytest.importorskip("madsci.client")

import hashlib
import json

from madsci.client.node.rest_node_client import RestNodeClient
from madsci.common.types.action_types import ActionRequest, ActionStatus

from labrl.lab_adapters import JobState, Journal, JournaledLab, JournaledLabConfig
from labrl.lab_adapters.madsci import MadsciNodeAdapter, MadsciNodeConfig


def digest(payload: dict) -> str:
    """What the mock lab's echo job reports (lab_adapters/mock/simlab.py)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def test_madsci_client_runs_mock_lab_jobs(mock_lab_node):
    client = RestNodeClient(mock_lab_node.url)
    info = client.get_info()
    assert {"echo", "calculation", "synthesis"} <= set(info.actions)

    payload = {"sample": "A1", "temperature_c": 850}
    echoed = client.send_action(ActionRequest(action_name="echo", args={"payload": payload}), timeout=60)
    assert echoed.status is ActionStatus.SUCCEEDED
    assert echoed.json_result == {"echo": payload, "digest": digest(payload)}

    refused = client.send_action(
        ActionRequest(action_name="calculation", args={"job": {"task": "melt"}}), timeout=60
    )
    assert refused.status is ActionStatus.FAILED
    # send_action keeps the errors only when the action ended within start's 0.5 s; the result route has them
    message = client.get_action_result(refused.action_id).errors[0].message
    assert "422" in message and "task must be energy, relax or lattice" in message
    assert client.get_status().ready, "a lab job that fails must not leave the node errored"


async def test_labrl_adapter_round_trip_through_the_mock_lab_node(mock_lab_node, tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    adapter = MadsciNodeAdapter(MadsciNodeConfig(node_url=mock_lab_node.url, poll_first_s=0.1), journal)
    lab = JournaledLab(adapter, journal, JournaledLabConfig(use_feed=False, wait_timeout_s=60.0))
    try:
        payload = {"n": 3}
        outcome = await lab.run({"action": "echo", "args": {"payload": payload}}, "node/echo-3")
        assert outcome.status.state is JobState.COMPLETED
        assert outcome.status.result == {"echo": payload, "digest": digest(payload)}
    finally:
        await adapter.aclose()
        await journal.close()
