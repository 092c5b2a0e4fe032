"""Rubric items: validation, deterministic kinds, units, and the score formula."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from labrl.errors import ConfigError
from labrl.verifiers.rubric import Rubric, RubricGrader, rubric_score, score_deterministic
from labrl.verifiers.rubric.items import ContainsItem, NumericItem, RegexItem, key_term_groups
from labrl.verifiers.rubric.quantities import find_quantities, matches


def test_ids_default_by_position_and_kind_defaults_to_llm() -> None:
    rubric = Rubric.model_validate({"items": [{"text": "a"}, {"id": "x", "text": "b"}, {"text": "c"}]})
    assert [i.id for i in rubric.items] == ["i0", "x", "i2"]
    assert {i.kind for i in rubric.items} == {"llm"}


def test_duplicate_ids_rejected() -> None:
    with pytest.raises(ValidationError, match=re.escape("duplicate item id 'x'")):
        Rubric.model_validate({"items": [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]})


def test_needs_a_positive_item() -> None:
    with pytest.raises(ValidationError, match=re.escape("a rubric needs at least one positive item")):
        Rubric.model_validate({"items": [{"text": "bad", "polarity": "negative"}]})


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"text": "t", "weight": 0}, "weight"),
        ({"text": "t", "kind": "regex", "pattern": "("}, "pattern"),
        ({"text": "t", "kind": "numeric", "value": 1, "tolerance": 1, "units": "furlongz"}, "units"),
        ({"text": "t", "kind": "numeric", "value": 1, "tolerance": -1}, "tolerance"),
        ({"text": "t", "kind": "contains", "terms": []}, "terms"),
        ({"text": "t", "kind": "judge"}, "kind"),
    ],
)
def test_bad_items_name_the_field(item: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        Rubric.model_validate({"items": [item]})
    assert field in str(info.value)


def test_unknown_unit_message() -> None:
    with pytest.raises(ValidationError, match=re.escape("unknown unit 'furlongz'")):
        NumericItem(kind="numeric", text="t", value=1, tolerance=1, units="furlongz")


def test_key_term_groups() -> None:
    assert key_term_groups("Names `rutile|TiO2 rutile` and `irreversible` but `` not") == [
        ("rutile", "TiO2 rutile"),
        ("irreversible",),
    ]


def test_regex_and_contains() -> None:
    regex = RegexItem(kind="regex", text="t", pattern=r"F\s*=\s*C\s*-\s*P\s*\+\s*2")
    assert score_deterministic(regex, "so f = c - p + 2 here") == 1.0  # ignore_case by default
    assert score_deterministic(regex.model_copy(update={"ignore_case": False}), "so f = c - p + 2") == 0.0
    both = ContainsItem(kind="contains", text="t", terms=("Ferrite", "cementite"))
    assert score_deterministic(both, "ferrite and CEMENTITE") == 1.0
    assert score_deterministic(both, "ferrite only") == 0.0
    assert score_deterministic(both.model_copy(update={"match": "any"}), "ferrite only") == 1.0


@pytest.mark.parametrize(
    ("text", "value", "tolerance", "units", "expected"),
    [
        ("calcined at 873 K", 600, 1, "degC", True),  # 873 K = 599.85 °C
        ("calcined at 873 K", 600, 0.1, "degC", False),
        ("heated to 1,000 °C in air", 1000, 0, "degC", True),  # "°C in" parses as °C*inch: falls back to °C
        ("heated to 600 C", 873.15, 0.01, "kelvin", True),  # bare C after a number means °C for temperatures
        ("a = 3.905 Å", 0.3905, 1e-6, "nm", True),
        ("density 4.23 g/cm^3", 4230, 1, "kg/m^3", True),
        ("about 5 GPa", 50, 1, "kbar", True),
        ("1.2 × 10^3 nm", 1.2, 1e-9, "um", True),
        ("600", 600, 1, "degC", False),  # a bare number never matches an item with units
        ("600 nm", 600, 1, "degC", False),  # incompatible dimensions
        ("K is 0.9 in radians", 0.9, 0.0, None, True),  # unit-less items ignore the word after the number
    ],
)
def test_numeric_units(text: str, value: float, tolerance: float, units: str | None, expected: bool) -> None:
    assert matches(text, value, tolerance, units) is expected


def test_numeric_anchor_window() -> None:
    text = "Calcine at 1100 °C. " + "x" * 100 + " Sinter at 1400 °C."
    item = NumericItem(kind="numeric", text="t", value=1400, tolerance=10, units="degC", anchor="calcin")
    assert score_deterministic(item, text) == 0.0  # 1400 °C is outside the 80-character window after "calcin"
    assert score_deterministic(item.model_copy(update={"anchor": "sinter"}), text) == 1.0
    assert score_deterministic(item.model_copy(update={"anchor": "absent"}), text) == 0.0


def test_find_quantities_offsets_and_candidates() -> None:
    assert find_quantities("at 873 K for 2 h") == [(873.0, ["K"], 3), (2.0, ["h"], 13)]


def _rubric() -> Rubric:
    return Rubric.model_validate(
        {
            "items": [
                {"id": "a", "text": "a", "weight": 3},
                {"id": "b", "text": "b", "weight": 1},
                {"id": "bad", "text": "bad", "weight": 2, "polarity": "negative"},
            ]
        }
    )


@pytest.mark.parametrize(
    ("scores", "score", "raw"),
    [
        ({"a": 1, "b": 1, "bad": 0}, 1.0, 4.0),
        ({"a": 1, "b": 0, "bad": 0}, 0.75, 3.0),  # 3 / 4
        ({"a": 0.5, "b": 1, "bad": 0.5}, 0.375, 1.5),  # (1.5 + 1 - 1) / 4
        ({"a": 1, "b": 1, "bad": 1}, 0.5, 2.0),  # (4 - 2) / 4
        ({"a": 0, "b": 1, "bad": 1}, 0.0, -1.0),  # (1 - 2) / 4 clipped to 0
    ],
)
def test_score_formula(scores: dict[str, float], score: float, raw: float) -> None:
    assert rubric_score(_rubric(), scores) == pytest.approx((score, raw))


def test_score_rejects_out_of_range_item() -> None:
    with pytest.raises(ValueError, match=re.escape("item 'a' has score 1.5, outside [0, 1]")):
        rubric_score(_rubric(), {"a": 1.5, "b": 0, "bad": 0})


async def test_deterministic_rubric_needs_no_judge() -> None:
    rubric = Rubric.model_validate(
        {
            "items": [
                {
                    "id": "t",
                    "kind": "numeric",
                    "text": "727 °C",
                    "value": 727,
                    "tolerance": 5,
                    "units": "degC",
                    "weight": 2,
                },
                {"id": "p", "kind": "contains", "text": "pearlite", "terms": ["pearlite"]},
                {
                    "id": "n",
                    "kind": "regex",
                    "text": "single phase",
                    "pattern": "single phase",
                    "polarity": "negative",
                },
            ]
        }
    )
    result = await RubricGrader().grade(rubric, "Pearlite forms at 1000 K, a single phase.")
    # 1000 K = 726.85 °C: t met; p met; n met -> (2 + 1 - 1) / 3
    assert result.score == pytest.approx(2 / 3)
    assert [(i.id, i.score) for i in result.items] == [("t", 1.0), ("p", 1.0), ("n", 1.0)]
    assert result.disagreement is None and result.judges == ()


async def test_llm_items_without_judges_is_config_error(rubric: Rubric) -> None:
    with pytest.raises(ConfigError, match=re.escape("rubric has 3 llm item(s) but the grader has no judges")):
        await RubricGrader().grade(rubric, "text")


def test_public_surface() -> None:
    import labrl.envs.judged as judged
    import labrl.verifiers.rubric as rubric

    assert sorted(rubric.__all__) == sorted(
        [
            "ContainsItem",
            "Disagreement",
            "ItemResult",
            "JudgeCache",
            "JudgeClient",
            "JudgeConfig",
            "LLMItem",
            "NumericItem",
            "RegexItem",
            "Rubric",
            "RubricGrader",
            "RubricItem",
            "RubricResult",
            "default_cache",
            "rubric_score",
            "score_deterministic",
        ]
    )
    assert all(hasattr(rubric, name) for name in rubric.__all__)
    assert sorted(judged.__all__) == [
        "QATask",
        "ScienceQAConfig",
        "ScienceQAEnv",
        "load_tasks",
        "parse_tasks",
    ]
