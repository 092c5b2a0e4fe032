"""A MADSci node written with ``madsci-node-module``, run as a script by the tests.

``python counting_node.py PORT LEDGER``: a standalone ``RestNode`` on 127.0.0.1:PORT
(no registry, no managers) with one action, ``measure(sample, seconds)``, that
appends ``start <sample>`` to the ledger file when it begins and ``end <sample>``
when it finishes: the tests count the lines to tell how many times an experiment
ran on the node side, across client and node restarts.
"""

import sys
import time
from pathlib import Path

from madsci.common.types.action_types import ActionFailed
from madsci.common.types.node_types import RestNodeConfig
from madsci.node_module.helpers import action
from madsci.node_module.rest_node_module import RestNode

LEDGER = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("ledger.txt")


class CountingNode(RestNode):
    @action
    def measure(self, sample: str, seconds: float) -> dict:
        """Hold the instrument ``seconds`` s, then report a reading derived from ``sample``."""
        with LEDGER.open("a") as ledger:
            ledger.write(f"start {sample}\n")
        time.sleep(seconds)
        with LEDGER.open("a") as ledger:
            ledger.write(f"end {sample}\n")
        return {"sample": sample, "reading": len(sample) * 1.5}

    @action
    def jam(self, sample: str) -> dict:
        """An instrument fault: always fails (an ActionFailed result; raising would mark the node errored)."""
        return ActionFailed(errors=f"instrument jammed on {sample}")


if __name__ == "__main__":
    port = int(sys.argv[1])
    config = RestNodeConfig(node_url=f"http://127.0.0.1:{port}", enable_registry_resolution=False)
    CountingNode(node_config=config).start_node()
