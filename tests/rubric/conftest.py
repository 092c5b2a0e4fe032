"""Fixtures for the rubric tests: judges backed by the mock app or by scripted handlers."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from labrl.verifiers.rubric import JudgeCache, JudgeClient, JudgeConfig, Rubric
from labrl.verifiers.rubric.mock_judge import MockJudgeConfig, create_app
from labrl.verifiers.rubric.prompt import read_prompt


async def _no_sleep(_: float) -> None:
    return None


@pytest.fixture
def rubric() -> Rubric:
    return Rubric.model_validate(
        {
            "items": [
                {"id": "stable", "text": "Names `rutile` as the stable polymorph", "weight": 2},
                {"id": "irrev", "text": "Says the change is `irreversible`", "weight": 1},
                {
                    "id": "temp",
                    "kind": "numeric",
                    "text": "About 600 °C",
                    "value": 600,
                    "tolerance": 100,
                    "units": "degC",
                },
                {
                    "id": "wrong",
                    "text": "Claims `anatase is the stable` form",
                    "weight": 2,
                    "polarity": "negative",
                },
            ]
        }
    )


@pytest.fixture
def mock_judge() -> Callable[..., tuple[JudgeClient, object]]:
    """``make(fault=..., **judge_config) -> (client, app)``: a client on an in-process mock app."""

    def make(mock: MockJudgeConfig | None = None, **config: object) -> tuple[JudgeClient, object]:
        app = create_app(mock or MockJudgeConfig())
        cfg = JudgeConfig(base_url="http://judge.test/v1", model=str(config.pop("model", "mock")), **config)  # type: ignore[arg-type]
        client = JudgeClient(cfg, cache=JudgeCache(), transport=httpx.ASGITransport(app=app), sleep=_no_sleep)
        return client, app

    return make


def scripted_transport(scores: dict[str, float]) -> httpx.MockTransport:
    """A judge that gives each criterion id a fixed score."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        criteria, _response, _question = read_prompt(body["messages"][1]["content"])
        content = json.dumps(
            {"scores": [{"id": cid, "rationale": "scripted", "score": scores[cid]} for cid, _ in criteria]}
        )
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})

    return httpx.MockTransport(handler)


@pytest.fixture
def scripted_judge() -> Callable[..., JudgeClient]:
    def make(scores: dict[str, float], model: str = "scripted", **config: object) -> JudgeClient:
        cfg = JudgeConfig(base_url="http://judge.test/v1", model=model, **config)  # type: ignore[arg-type]
        return JudgeClient(cfg, cache=JudgeCache(), transport=scripted_transport(scores), sleep=_no_sleep)

    return make
