"""One Ray cluster for every Ray test (starting one costs seconds to tens of seconds on 2 loaded cores).

A ``ray.cluster_utils.Cluster``: the head node has 2 CPUs (the "local Ray" of
the single-node tests); the node-loss test adds a node and removes it. Every
worker process runs ``ray_test_envs.register_all`` (Ray's
``worker_process_setup_hook``) so the test envs resolve inside the actors.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray_test_envs
    from ray.cluster_utils import Cluster
    from ray_helpers import LAB_TOKEN

    ray_test_envs.register_all()
    cluster = None
    for attempt in range(3):  # Ray gives a raylet 30 s to register: not always enough on 2 loaded cores
        try:
            cluster = Cluster(
                initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
            )
            break
        except Exception:
            if attempt == 2:
                raise
    ray.init(
        address=cluster.address,
        logging_level="WARNING",
        runtime_env={
            "worker_process_setup_hook": "ray_test_envs.register_all",
            # the lab key every actor process would get from its node's environment on a real cluster
            "env_vars": {"LABRL_LAB_API_KEY": LAB_TOKEN},
        },
    )
    yield cluster
    ray.shutdown()
    cluster.shutdown()
