"""ObjectiveConfig: defaults, dict/YAML construction, and errors that name the field."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

import labrl.harness.objectives as objectives
from labrl.errors import ConfigError
from labrl.harness.objectives import M2PO, TIS, ObjectiveConfig, Veto


def test_defaults_follow_the_reference() -> None:
    cfg = ObjectiveConfig()
    assert (cfg.loss, cfg.advantages, cfg.aggregation) == ("cispo", "grpo", "token_mean")
    assert (cfg.eps_low, cfg.eps_high) == (1.0, 0.28)
    assert cfg.corrections == [TIS(c=2.0, level="token")]
    assert cfg.kl_coef == 0.0
    assert ObjectiveConfig(loss="ppo").clip_range == (0.8, 1.28)
    assert (ObjectiveConfig(loss="gspo").eps_low, ObjectiveConfig(loss="gspo").eps_high) == (3e-4, 4e-4)
    assert ObjectiveConfig(loss="reinforce").eps_low is None
    assert M2PO().tau == 0.04 and Veto().floor == 1e-4
    assert ObjectiveConfig(loss="ppo", eps_high=0.4).eps_low == 0.2  # per-field default kept


def test_python_construction_matches_the_issue_example() -> None:
    cfg = ObjectiveConfig(
        loss="cispo", advantages="grpo", corrections=[TIS(c=2), M2PO(tau=0.04)], aggregation="token_mean"
    )
    assert [c.name for c in cfg.corrections] == ["tis_token", "m2po"]


def test_from_dict_and_round_trip() -> None:
    cfg = ObjectiveConfig.from_dict(
        {"loss": "cispo", "corrections": [{"kind": "tis", "c": 2.0}, "m2po", "veto"]}
    )
    assert cfg.corrections == [TIS(c=2.0), M2PO(), Veto()]
    assert ObjectiveConfig.from_dict(cfg.model_dump()) == cfg
    assert ObjectiveConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_from_yaml(tmp_path) -> None:
    text = """
objective:
  loss: ppo
  eps_high: 0.3
  advantages: rloo
  aggregation: seq_sum_constant
  aggregation_constant: 4096
  corrections:
    - {kind: tis, level: sequence}
    - {kind: token_mask, low: 0.5, high: 2.0}
"""
    cfg = ObjectiveConfig.from_yaml(text)
    assert (cfg.loss, cfg.eps_low, cfg.eps_high, cfg.advantages) == ("ppo", 0.2, 0.3, "rloo")
    assert cfg.corrections[0].c == 5.0 and cfg.corrections[1].high == 2.0
    path = tmp_path / "obj.yaml"
    path.write_text(text)
    assert ObjectiveConfig.from_yaml(path) == cfg
    assert ObjectiveConfig.from_yaml(str(path)) == cfg


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"corrections": [{"kind": "tis", "c": 0.5}]},
            "invalid objective config: corrections.0.tis.c: Input should be greater than or equal to 1",
        ),
        (
            {"aggregation": "seq_sum_constant"},
            "invalid objective config: aggregation=seq_sum_constant requires aggregation_constant: "
            "set it to the max generation length",
        ),
        (
            {"aggregation_constant": 100.0},
            "invalid objective config: aggregation_constant is only used by aggregation=seq_sum_constant "
            "(got aggregation=token_mean)",
        ),
        (
            {"loss": "reinforce", "eps_low": 0.1},
            "invalid objective config: eps_low / eps_high have no effect with loss=reinforce: remove them or use ppo/cispo",
        ),
        (
            {"corrections": ["tis", "tis"]},
            "invalid objective config: corrections lists tis_token more than once",
        ),
        (
            {"corrections": [{"kind": "token_mask", "low": 1.5}]},
            "invalid objective config: corrections.0.token_mask: token_mask needs low <= 1 <= high "
            "so on-policy tokens are kept (got low=1.5, high=5.0)",
        ),
        (
            {"corrections": [{"kind": "foo"}]},
            "invalid objective config: corrections.0: Input tag 'foo' found using 'kind' does not match",
        ),
        (
            {"loss": "ppo2"},
            "invalid objective config: loss: Input should be 'reinforce', 'ppo', 'cispo', 'gspo' or 'sapo'",
        ),
        ({"los": "ppo"}, "invalid objective config: los: Extra inputs are not permitted"),
        ({"eps_low": 0}, "invalid objective config: eps_low: Input should be greater than 0"),
        ({"corrections": [{"kind": "m2po", "tau": -1}]}, "invalid objective config: corrections.0.m2po.tau"),
    ],
)
def test_errors_name_the_field(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ObjectiveConfig.from_dict(data)


def test_direct_construction_raises_pydantic_error_naming_the_field() -> None:
    with pytest.raises(
        ValidationError, match=re.escape("kl_coef\n  Input should be greater than or equal to 0")
    ):
        ObjectiveConfig(kl_coef=-1.0)


def test_from_yaml_errors() -> None:
    with pytest.raises(ConfigError, match=re.escape("objective config must be a mapping, got list")):
        ObjectiveConfig.from_yaml("- loss: ppo\n")
    with pytest.raises(
        ConfigError, match=re.escape("objective config file not found: /nonexistent/obj.yaml")
    ):
        ObjectiveConfig.from_yaml("/nonexistent/obj.yaml")


def test_public_surface() -> None:
    assert set(objectives.__all__) == {
        name for name in dir(objectives) if not name.startswith("_") and name not in {"annotations"}
    }
    for name in (
        "ObjectiveConfig",
        "ObjectiveInputs",
        "PreparedBatch",
        "prepare",
        "policy_loss",
        "combine_metrics",
    ):
        assert name in objectives.__all__
