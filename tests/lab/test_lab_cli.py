from __future__ import annotations

import re

import pytest

import labrl.lab_adapters as lab_adapters
from labrl.cli import main
from labrl.commands.lab import add_parser, build_config
from labrl.errors import ConfigError


def test_public_surface():
    assert set(lab_adapters.__all__) == {
        "CompletionEvent",
        "EventPage",
        "JobOutcome",
        "JobRef",
        "JobState",
        "JobStatus",
        "Journal",
        "JournalEntry",
        "JournaledLab",
        "JournaledLabConfig",
        "LabAdapter",
        "RestLabAdapter",
        "RestLabConfig",
        "SimulatorAdapter",
        "SupportsEvents",
        "SupportsSubmitStatus",
        "request_hash",
    }


def _args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="group"))
    return parser.parse_args(["lab", "serve-mock", *argv])


def test_serve_mock_flags_build_the_config(tmp_path):
    config = build_config(
        _args(
            [
                "--state-dir",
                str(tmp_path),
                "--port",
                "9999",
                "--error-rate",
                "0.1",
                "--hang-rate",
                "0.05",
                "--duplicate-rate",
                "0.02",
                "--latency-median",
                "0.5",
            ]
        )
    )
    assert (config.port, config.latency_median_s, config.state_dir) == (9999, 0.5, tmp_path)
    assert (config.faults.error_rate, config.faults.hang_rate, config.faults.duplicate_rate) == (
        0.1,
        0.05,
        0.02,
    )


def test_serve_mock_refuses_non_loopback(tmp_path):
    with pytest.raises(
        ConfigError,
        match=re.escape("the mock lab binds to loopback only (127.0.0.1, ::1, localhost), got '0.0.0.0'"),
    ):
        build_config(_args(["--host", "0.0.0.0", "--state-dir", str(tmp_path)]))
    assert main(["lab", "serve-mock", "--host", "10.0.0.1", "--state-dir", str(tmp_path)]) == 2


def test_serve_mock_needs_a_token(tmp_path, monkeypatch):
    from labrl.lab_adapters.mock.server import MockLabConfig, create_app

    monkeypatch.delenv("LABRL_MOCK_LAB_TOKEN", raising=False)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "the mock lab needs a bearer token: set the environment variable LABRL_MOCK_LAB_TOKEN"
        ),
    ):
        create_app(MockLabConfig(state_dir=tmp_path))


def test_serve_madsci_node_without_the_extra_says_what_to_install(capsys):
    import importlib.util

    if importlib.util.find_spec("madsci") is not None:
        pytest.skip("the madsci extra is installed here (tests/interop/madsci runs the node)")
    assert main(["lab", "serve-madsci-node", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.endswith("pip install 'labrl[madsci]'")
