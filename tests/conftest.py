"""Test-session set-up shared by every area."""

from __future__ import annotations

import os

import pytest

from labrl._warnings import quiet_expected_warnings


def export_pythonpath(config: pytest.Config) -> None:
    """pytest puts the ini's ``pythonpath`` folders on sys.path of this process only; child processes
    (subprocess CLIs, process-pool and Ray workers) import the same fixture modules by name."""
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = [str(p) for p in config.getini("pythonpath")]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in [*paths, *inherited] if p))


def cores_per_worker() -> int:
    """This process's share of the cores: torch's default pool, one thread per core, in each
    pytest-xdist worker oversubscribes them (tests/learner on 2 workers took 3x the CPU time of one
    process)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


@pytest.fixture
def torch_threads() -> int:
    """torch's intra-op threads a test starts with: the worker's share of the cores. An area's
    conftest overrides it (one thread where its tensors are too small to split)."""
    return cores_per_worker()


@pytest.fixture(autouse=True)
def _start_with_torch_threads(torch_threads: int) -> None:
    """Set before every test, not once at import: a count set at import by a conftest, or by a test or
    an in-process run (the runner sets ``pipeline.torch_threads``), held for every later test of the
    worker, so the last conftest collected chose it for the whole session (2 threads in each of two
    workers on 2 cores)."""
    import torch

    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


def pytest_configure(config: pytest.Config) -> None:
    export_pythonpath(config)
    # pytest rebuilds warning filters for every test from its ini filters: add ours there
    from labrl._warnings import expected_warnings

    for message, category, module in expected_warnings():
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}:{module}")
    quiet_expected_warnings()


@pytest.fixture(scope="session")
def fixture_envs():
    """The fixture envs of ``tests/support/labrl_test_envs.py`` registered for the session (autouse where a
    folder's conftest asks for it)."""
    from labrl_test_envs import FIXTURES

    from labrl.envs import deregister, register, registered_ids

    registered_ids()  # load built-ins first so fixture ids never shadow them
    for env_id, cls in FIXTURES.items():
        register(env_id, entry_point=f"labrl_test_envs:{cls.__name__}", source="tests")
    yield
    for env_id in FIXTURES:
        deregister(env_id)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
