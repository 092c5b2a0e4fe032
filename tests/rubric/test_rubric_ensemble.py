"""Ensembles of judges and samples: mean / median and the reported disagreement."""

from __future__ import annotations

import re

import pytest

from labrl.errors import ConfigError, VerifierError
from labrl.verifiers.rubric import Rubric, RubricGrader
from labrl.verifiers.rubric.mock_judge import MockJudgeConfig

RUBRIC = Rubric.model_validate(
    {
        "items": [
            {"id": "a", "text": "a", "weight": 3},
            {"id": "b", "text": "b", "weight": 1},
            {"id": "bad", "text": "bad", "weight": 2, "polarity": "negative"},
            {"id": "num", "kind": "contains", "text": "says ok", "terms": ["ok"]},
        ]
    }
)


async def test_mean_median_and_disagreement(scripted_judge) -> None:
    judges = [
        scripted_judge({"a": 1.0, "b": 1.0, "bad": 0.0}, model="j1"),
        scripted_judge({"a": 0.5, "b": 0.0, "bad": 0.0}, model="j2"),
        scripted_judge({"a": 0.0, "b": 1.0, "bad": 1.0}, model="j3"),
    ]
    mean = await RubricGrader(judges, "mean").grade(RUBRIC, "ok then")
    a, b, bad, num = mean.items
    assert a.member_scores == (1.0, 0.5, 0.0) and a.score == pytest.approx(0.5)
    assert a.range == 1.0 and a.std == pytest.approx((1 / 6) ** 0.5)  # pstdev of (1, .5, 0)
    assert b.score == pytest.approx(2 / 3) and bad.score == pytest.approx(1 / 3) and num.score == 1.0
    # positive weight 3 + 1 + 1 = 5; raw = 3*.5 + 2/3 + 1 - 2/3 = 2.5
    assert mean.score == pytest.approx(0.5) and mean.raw == pytest.approx(2.5)
    # each judge alone: (3 + 1 + 1)/5 = 1, (1.5 + 0 + 1)/5 = .5, (0 + 1 + 1 - 2)/5 = 0
    assert mean.member_scores == pytest.approx((1.0, 0.5, 0.0))
    d = mean.disagreement
    assert d is not None and d.members == 3 and d.score_range == 1.0 and d.max_item_range == 1.0
    assert d.score_std == pytest.approx((1 / 6) ** 0.5)
    assert mean.judges == ("j1", "j2", "j3")

    median = await RubricGrader(judges, "median").grade(RUBRIC, "ok then")
    # medians: a .5, b 1, bad 0 -> (1.5 + 1 + 1) / 5
    assert [i.score for i in median.items] == [0.5, 1.0, 0.0, 1.0]
    assert median.score == pytest.approx(0.7)


async def test_samples_are_members(mock_judge) -> None:
    rubric = Rubric.model_validate({"items": [{"id": "k", "text": "`rutile`"}]})
    client, app = mock_judge(samples=3, temperature=0.7)
    result = await RubricGrader([client]).grade(rubric, "rutile it is")
    assert result.item("k").member_scores == (1.0, 1.0, 1.0)
    assert (
        result.disagreement is not None
        and result.disagreement.members == 3
        and result.disagreement.score_std == 0.0
    )
    assert app.state.judge.requests == 3  # samples are separate requests and separate cache entries


async def test_one_failing_member_fails_the_grade(mock_judge, scripted_judge) -> None:
    good = scripted_judge({"k": 1.0}, model="good")
    broken, _ = mock_judge(MockJudgeConfig(fault="garbage"), model="broken")
    rubric = Rubric.model_validate({"items": [{"id": "k", "text": "`rutile`"}]})
    with pytest.raises(
        VerifierError, match=re.escape("judge 'broken' gave an unusable answer: judge answer is not JSON")
    ):
        await RubricGrader([good, broken]).grade(rubric, "rutile")


def test_bad_aggregate() -> None:
    with pytest.raises(ConfigError, match=re.escape("aggregate must be 'mean' or 'median', got 'max'")):
        RubricGrader([], "max")  # type: ignore[arg-type]
