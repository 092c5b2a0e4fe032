"""A lab with labrl's REST API (the mock lab by default) served as a MADSci node.

``labrl lab serve-madsci-node`` starts it (docs/interop.md#madsci). The node is a
``madsci-node-module`` ``RestNode``, standalone (no registry, no managers), whose
actions are the mock lab's job kinds::

    echo(payload: dict)          -> {"echo": payload, "digest": sha256 of its canonical JSON}
    calculation(job: dict)       -> the ASE calculation's result   (job: the request without "kind")
    synthesis(job: dict)         -> the synthesis and its XRD pattern

An action submits ``{"kind": <action>, **job}`` to the lab through
``RestLabAdapter`` (timeouts, retries, one idempotency key per action run, so a
retried submit is the same lab job) and waits for it. A lab job that does not
complete ends the action ``failed`` with the lab's reason, as an ``ActionFailed``
result: raising would mark the whole node errored and refuse later actions.

This module imports madsci at module level; import it only through
``labrl.extras.import_extra`` (the CLI does), so the core never needs the extra.
"""

import asyncio
import uuid
from typing import Any

from madsci.common.types.action_types import ActionFailed
from madsci.common.types.node_types import RestNodeConfig
from madsci.node_module.helpers import action
from madsci.node_module.rest_node_module import RestNode
from pydantic import Field

from labrl.errors import LabError
from labrl.lab_adapters.protocol import JobState
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

# No ``from __future__ import annotations`` here: madsci reads the action signatures'
# annotations as types, and a string annotation ("dict") is refused at node start.


class LabNodeConfig(RestNodeConfig):
    """The MADSci node's settings plus where the labrl lab is."""

    job_lab_url: str = Field(description="base URL of the labrl REST lab the actions submit to")
    job_lab_key_env: str = Field(
        default="LABRL_LAB_API_KEY", description="environment variable holding the lab's API key"
    )
    job_timeout_s: float = Field(default=3600.0, gt=0, description="an action waits this long for its job")


async def run_lab_job(lab_config: RestLabConfig, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Submit ``request`` under a fresh key and wait; the result, or ``LabError`` saying why none."""
    async with RestLabAdapter(lab_config) as lab:
        status = await lab.submit_status(request, f"madsci-node/{uuid.uuid4().hex}")
        if not status.state.terminal:
            status = await lab.wait(status.ref, timeout_s)
    if status.state is not JobState.COMPLETED or status.result is None:
        raise LabError(f"lab job {status.job_id} ended {status.state.value}: {status.error or 'no result'}")
    return status.result


class LabNode(RestNode):
    """The node; see the module docstring."""

    config_model = LabNodeConfig
    config: LabNodeConfig

    def _run(self, request: dict[str, Any]) -> Any:
        lab_config = RestLabConfig(base_url=self.config.job_lab_url, api_key_env=self.config.job_lab_key_env)
        try:
            # an action runs on a thread of its own, so it may own an event loop for the job's lifetime
            return asyncio.run(run_lab_job(lab_config, request, self.config.job_timeout_s))
        except LabError as exc:
            return ActionFailed(errors=f"{type(exc).__name__}: {exc}")

    @action
    def echo(self, payload: dict) -> dict:
        """The lab's echo job: the payload back, with the sha256 of its canonical JSON."""
        return self._run({"kind": "echo", "payload": payload})

    @action
    def calculation(self, job: dict) -> dict:
        """An ASE calculation (the fields of a labrl ``calculation`` job, without "kind")."""
        return self._run({"kind": "calculation", **job})

    @action
    def synthesis(self, job: dict) -> dict:
        """A solid-state synthesis and its XRD measurement (a labrl ``synthesis`` job, without "kind")."""
        return self._run({"kind": "synthesis", **job})


def serve_node(
    port: int, lab_url: str, *, host: str = "127.0.0.1", key_env: str = "LABRL_LAB_API_KEY"
) -> None:
    """Run the node on ``host:port`` until it is stopped (uvicorn, in this thread)."""
    config = LabNodeConfig(
        node_url=f"http://{host}:{port}",
        enable_registry_resolution=False,
        job_lab_url=lab_url,
        job_lab_key_env=key_env,
    )
    LabNode(node_config=config).start_node()
