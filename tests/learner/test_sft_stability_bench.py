"""``benchmarks/sft_stability.py``: its rise statistic, variant parsing, and a two-variant CPU run merged."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def bench() -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module("sft_stability")


def test_rise_is_the_largest_climb_above_the_best_loss_so_far():
    rise = bench().rise
    assert rise([6.0, 5.0, 4.0]) == 0.0  # never went up
    assert rise([6.1, 5.1, 10.4, 7.0]) == pytest.approx(5.3)  # the h100 warm start's step 3 at lr 5e-4
    assert rise([5.0, 6.0, 3.0, 4.5]) == pytest.approx(1.5)  # measured from the best before, not the first
    assert rise([]) == 0.0


def test_variants_parse_and_bad_ones_are_refused():
    parse = bench().parse_variant
    assert parse("asis:") == ("asis", [])
    assert parse("w25:sft.warmup_steps=25, sft.lr=3e-4") == ("w25", ["sft.warmup_steps=25", "sft.lr=3e-4"])
    for bad in ("nocolon", ":sft.lr=1", "a b:sft.lr=1", "x:sft.lr"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


@pytest.mark.timeout(600)
def test_two_variants_run_resume_and_merge(tmp_path, monkeypatch, capsys):
    mod = bench()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    args = [
        "--config",
        "configs/quickstart.yaml",
        "--steps",
        "3",
        "--set",
        "sft.batch_size=2",
        "--set",
        "sft.steps=10",
        "--variant",
        "asis:",
        "--variant",
        "warm:sft.warmup_steps=4",
        "--tag",
        "t",
    ]
    assert mod.main(args) == 0
    parts = {p.name: json.loads(p.read_text()) for p in (tmp_path / "sft_stability_t").glob("*.json")}
    assert sorted(parts) == ["asis_seed0.json", "warm_seed0.json"]
    for part in parts.values():
        assert part["complete"] and [r["sft_step"] for r in part["records"]] == [1, 2, 3]
    lr = 1e-3 * 3  # the quickstart's sft.lr is 3e-3
    assert [r["lr"] for r in parts["warm_seed0.json"]["records"]] == pytest.approx(
        [lr / 5, 2 * lr / 5, 3 * lr / 5]
    )
    assert parts["asis_seed0.json"]["records"][0]["lr"] == pytest.approx(lr)
    # the same model and prompts (seed 0): step 1's loss is the same before either update
    assert parts["asis_seed0.json"]["records"][0]["loss"] == parts["warm_seed0.json"]["records"][0]["loss"]
    capsys.readouterr()
    assert mod.main(args) == 0  # finished parts are skipped, not redone
    assert capsys.readouterr().out.count("done, skipped") == 2
    assert mod.main(["--merge", "--tag", "t"]) == 0
    merged = json.loads((tmp_path / "sft_stability_t.json").read_text())
    assert set(merged["variants"]) == {"asis", "warm"}
    assert merged["variants"]["warm"]["overrides"] == ["sft.warmup_steps=4"]
    assert all(r["steps"] == 3 and r["rise"] >= 0 for r in merged["parts"])
    assert (tmp_path / "sft_stability_t.png").stat().st_size > 0


def test_a_config_without_a_warm_start_is_refused(tmp_path, monkeypatch):
    mod = bench()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    with pytest.raises(SystemExit, match=r"sft\.enabled is false"):
        mod.main(["--config", "configs/quickstart.yaml", "--set", "sft.enabled=false", "--steps", "1"])
