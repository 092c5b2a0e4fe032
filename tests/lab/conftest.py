from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from labrl.lab_adapters.mock.process import MockLabProcess
from labrl.lab_adapters.mock.server import FaultConfig, MockLabConfig

TOKEN = "tok-3f9a1c77e2"  # a recognisable value the log checks search for


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("LABRL_LAB_API_KEY", TOKEN)
    return TOKEN


def start_mock(state_dir: Path, faults: FaultConfig | None = None, **overrides) -> MockLabProcess:
    settings = {"latency_median_s": 0.05, "latency_sigma": 0.5, **overrides}
    config = MockLabConfig(state_dir=state_dir, port=0, faults=faults or FaultConfig(), **settings)
    return MockLabProcess(config, token=TOKEN).start()


@pytest.fixture
def mock_lab(tmp_path: Path) -> Iterator[MockLabProcess]:
    lab = start_mock(tmp_path / "lab")
    try:
        yield lab
    finally:
        lab.stop()
