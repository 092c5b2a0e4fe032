"""``labrl envs show ID --json`` (the manifest) and ``labrl envs serve`` without a protocol's extra."""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib.metadata import version

import pytest

from labrl.cli import main
from labrl.interop.manifest import manifest, with_extra


def test_the_manifest_says_what_the_env_is_and_how_to_act(capsys):
    assert main(["envs", "show", "xrd/phase-id-v0", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["name"] == "xrd/phase-id-v0" and shown["route_name"] == "xrd--phase-id-v0"
    assert shown["version"] == "v0" and shown["author"] == "labrl" and shown["splits"] == ["train", "test"]
    assert shown["description"].startswith("identify crystalline phases")
    assert shown["budgets"]["max_turns"] == 1 and shown["has_gold_answer"] is True
    assert shown["action"]["schema"]["required"] == ["text"]
    assert {"messages", "tools", "outcome", "error", "task"} <= set(
        shown["observation"]["schema"]["properties"]
    )
    assert "verifier_failed" in shown["observation"]["description"]
    assert shown["dependencies"] == {"python": ">=3.11", "packages": [f"labrl=={version('labrl')}"]}
    assert {"name": "tier", "default": 1, "type": "Literal[1, 2, 3]", "description": ""} in shown["options"]
    assert shown == manifest("xrd/phase-id-v0")  # JSON values only: the CLI prints what a route serves


def test_options_reach_the_manifest_and_a_protocol_adds_its_extra(capsys):
    assert main(["envs", "show", "xrd/phase-id-tools-v0", "--json", "-o", 'budgets={"max_turns": 3}']) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["budgets"]["max_turns"] == 3
    assert {t["name"] for t in shown["tools"]} >= {"search_phases", "simulate", "fit"}
    served = with_extra(shown, "openenv")
    assert served["dependencies"]["packages"] == [f"labrl[openenv]=={version('labrl')}"]
    assert shown["dependencies"]["packages"] == [f"labrl=={version('labrl')}"]  # not modified


def test_serve_without_the_extra_is_one_line_naming_it(capsys):
    if importlib.util.find_spec("openenv") is not None:
        pytest.skip("the openenv extra is installed")
    assert main(["envs", "serve", "xrd/phase-id-v0", "--protocol", "openenv", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'labrl[openenv]'" in err


def test_the_ors_server_needs_no_extra():
    """labrl's ORS server is its own (``labrl[ors]`` is the SDK's client, for harnesses and tests)."""
    from labrl.interop.servers import ServeSettings, app_factory

    app = app_factory("ors")(ServeSettings(env_id="xrd/phase-id-tools-v0"))
    assert app.name == "xrd--phase-id-tools-v0"
    assert "openreward" not in sys.modules


def test_serve_offers_the_registered_protocols(capsys):
    with pytest.raises(SystemExit):
        main(["envs", "serve", "xrd/phase-id-v0", "--protocol", "gopher"])
    assert "invalid choice: 'gopher' (choose from 'openenv', 'ors')" in capsys.readouterr().err
