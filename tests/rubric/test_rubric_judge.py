"""The judge client: batching, caching, retries, timeouts, strict parsing, API keys."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from labrl.envs.budgets import STOPS_THE_RUN
from labrl.errors import ConfigError, JudgeAuthError, JudgeError, VerifierError
from labrl.redact import MASK
from labrl.verifiers.rubric import JudgeCache, JudgeClient, JudgeConfig, Rubric, RubricGrader
from labrl.verifiers.rubric.mock_judge import MockJudgeConfig, serve_in_thread
from labrl.verifiers.rubric.prompt import parse_scores

GOOD = "Rutile is stable; the change at 873 K is irreversible."


async def test_mock_judge_scores_key_terms(mock_judge, rubric: Rubric) -> None:
    client, app = mock_judge()
    result = await RubricGrader([client]).grade(rubric, GOOD, "Which TiO2 polymorph is stable?")
    assert {i.id: i.score for i in result.items} == {"stable": 1.0, "irrev": 1.0, "temp": 1.0, "wrong": 0.0}
    assert result.score == 1.0
    result = await RubricGrader([client]).grade(
        rubric, "Anatase is the stable form, rutile appears at 900 °C."
    )
    # stable 2 (rutile present) + irrev 0 + temp 0 (900 ± 100 misses 600) - wrong 2 -> 0 / 4
    assert {i.id: i.score for i in result.items} == {"stable": 1.0, "irrev": 0.0, "temp": 0.0, "wrong": 1.0}
    assert result.score == 0.0 and result.raw == 0.0
    assert app.state.judge.requests == 2  # batch="response": one request per response


async def test_request_asks_for_json_schema(mock_judge, rubric: Rubric) -> None:
    client, app = mock_judge(model="judge-x", temperature=0.3, extra_body={"top_p": 0.9})
    await client.judge(rubric.llm_items, GOOD)
    body = app.state.judge.bodies[-1]
    assert body["model"] == "judge-x" and body["temperature"] == 0.3 and body["top_p"] == 0.9
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    assert schema["properties"]["scores"]["items"]["properties"]["id"]["enum"] == ["stable", "irrev", "wrong"]


async def test_one_call_per_item_mode(mock_judge, rubric: Rubric) -> None:
    client, app = mock_judge(batch="item", samples=2)
    scores = await client.judge(rubric.llm_items, GOOD)
    assert app.state.judge.requests == 6  # 3 llm items x 2 samples
    assert {k: [s for s, _ in v] for k, v in scores.items()} == {
        "stable": [1.0, 1.0],
        "irrev": [1.0, 1.0],
        "wrong": [0.0, 0.0],
    }


async def test_cache_hits_skip_requests_and_key_on_response(mock_judge, rubric: Rubric) -> None:
    client, app = mock_judge()
    await client.judge(rubric.llm_items, GOOD)
    await client.judge(rubric.llm_items, GOOD)
    assert app.state.judge.requests == 1 and client.stats.cache_hits == 3
    await client.judge(rubric.llm_items, GOOD + " ")  # another response hash: asked again
    assert app.state.judge.requests == 2
    # a new item with the same response: only that item is asked for
    extra = Rubric.model_validate(
        {"items": [{"id": "new", "text": "`stable`"}, *rubric.model_dump()["items"]]}
    )
    await client.judge(extra.llm_items, GOOD)
    assert app.state.judge.requests == 3
    assert (
        len(
            app.state.judge.bodies[-1]["response_format"]["json_schema"]["schema"]["properties"]["scores"][
                "items"
            ]["properties"]["id"]["enum"]
        )
        == 1
    )


async def test_cache_keyed_by_model(mock_judge, rubric: Rubric) -> None:
    shared = JudgeCache()
    a, app_a = mock_judge(model="a")
    b, app_b = mock_judge(model="b")
    a.cache = b.cache = shared
    await a.judge(rubric.llm_items, GOOD)
    await b.judge(rubric.llm_items, GOOD)
    assert (app_a.state.judge.requests, app_b.state.judge.requests) == (1, 1)
    assert len(shared) == 6


async def test_cache_disabled(mock_judge, rubric: Rubric) -> None:
    client, app = mock_judge(cache=False)
    await client.judge(rubric.llm_items, GOOD)
    await client.judge(rubric.llm_items, GOOD)
    assert app.state.judge.requests == 2


def test_cache_is_bounded() -> None:
    cache = JudgeCache(max_entries=2)
    cache.put("a", (1.0, ""))
    cache.put("b", (0.0, ""))
    assert cache.get("a") == (1.0, "")  # a becomes most recent
    cache.put("c", (0.5, ""))
    assert cache.get("b") is None and cache.get("a") == (1.0, "") and len(cache) == 2


@pytest.mark.parametrize("fault", ["http_500", "http_429"])
async def test_retries_then_succeeds(mock_judge, rubric: Rubric, fault: str) -> None:
    client, app = mock_judge(MockJudgeConfig(fault=fault, fail_first=2), max_retries=2)
    scores = await client.judge(rubric.llm_items, GOOD)
    assert scores["stable"][0][0] == 1.0
    assert app.state.judge.requests == 3 and client.stats.retries == 2


async def test_retries_exhausted_is_judge_error(mock_judge, rubric: Rubric) -> None:
    client, app = mock_judge(MockJudgeConfig(fault="http_500"), max_retries=2)
    with pytest.raises(JudgeError, match=re.escape("failed after 3 attempt(s): HTTP 500")):
        await client.judge(rubric.llm_items, GOOD)
    assert app.state.judge.requests == 3


async def test_grader_turns_judge_failure_into_verifier_error(mock_judge, rubric: Rubric) -> None:
    client, _ = mock_judge(MockJudgeConfig(fault="http_500"), max_retries=0)
    with pytest.raises(
        VerifierError, match=re.escape("judge 'mock' failed: judge 'mock' at http://judge.test/v1")
    ):
        await RubricGrader([client]).grade(rubric, GOOD)


async def test_backoff_schedule_and_retry_after() -> None:
    statuses = iter([503, 503, 429, 503, 200])
    content = json.dumps({"scores": [{"id": "i0", "rationale": "", "score": 1}]})

    def handler(request: httpx.Request) -> httpx.Response:
        status = next(statuses)
        if status == 200:
            return httpx.Response(200, json={"choices": [{"message": {"content": content}}]})
        return httpx.Response(status, headers={"Retry-After": "7"} if status == 429 else {})

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    cfg = JudgeConfig(base_url="http://j/v1", model="m", max_retries=4, backoff_s=0.5, backoff_max_s=3.0)
    client = JudgeClient(cfg, cache=JudgeCache(), transport=httpx.MockTransport(handler), sleep=sleep)
    rubric = Rubric.model_validate({"items": [{"text": "x"}]})
    assert (await client.judge(rubric.llm_items, "answer text"))["i0"] == [(1.0, "")]
    # 0.5 * 2**k capped at 3.0; the 429's Retry-After of 7 s is capped at 3.0 too
    assert slept == [0.5, 1.0, 3.0, 3.0]


async def test_client_errors_are_not_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(400, text="bad model")

    client = JudgeClient(
        JudgeConfig(base_url="http://j/v1", model="m"),
        cache=JudgeCache(),
        transport=httpx.MockTransport(handler),
    )
    rubric = Rubric.model_validate({"items": [{"text": "x"}]})
    with pytest.raises(JudgeError, match=re.escape("refused the request: HTTP 400: 'bad model'")) as info:
        await client.judge(rubric.llm_items, "answer")
    assert calls == 1
    assert not isinstance(info.value, STOPS_THE_RUN)  # a bad request is this grade's failure only


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_credentials_stop_the_run_and_never_show_the_key(status, monkeypatch, caplog) -> None:
    """401/403 is a setup error, as a lab's is: JudgeAuthError (in STOPS_THE_RUN), not retried, the
    variable named, the key (even echoed back by the judge) never in the message or the logs."""
    secret = "sk-judge-0123456789abcdef"
    monkeypatch.setenv("LABRL_TEST_JUDGE_KEY", secret)
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(status, text=f"bad key: {request.headers['authorization']}")

    cfg = JudgeConfig(base_url="http://j/v1", model="m", api_key_env="LABRL_TEST_JUDGE_KEY", max_retries=3)
    client = JudgeClient(cfg, cache=JudgeCache(), transport=httpx.MockTransport(handler))
    rubric = Rubric.model_validate({"items": [{"text": "x"}]})
    with caplog.at_level(logging.DEBUG), pytest.raises(JudgeAuthError) as info:
        await RubricGrader([client]).grade(rubric, "answer")  # the grader lets it through
    message = str(info.value)
    assert message == (
        f"judge 'm' at http://j/v1/chat/completions refused the credentials in $LABRL_TEST_JUDGE_KEY: "
        f"HTTP {status}: 'bad key: Bearer {MASK}'"
    )
    assert calls == 1 and isinstance(info.value, STOPS_THE_RUN)
    assert secret not in message and secret not in caplog.text


async def test_refused_request_without_a_key_says_how_to_send_one() -> None:
    client = JudgeClient(
        JudgeConfig(base_url="http://j/v1", model="m"),
        cache=JudgeCache(),
        transport=httpx.MockTransport(lambda request: httpx.Response(401, text="no key")),
    )
    rubric = Rubric.model_validate({"items": [{"text": "x"}]})
    with pytest.raises(
        JudgeAuthError, match=re.escape("refused a request without credentials (set api_key_env")
    ):
        await client.judge(rubric.llm_items, "answer")


async def test_transport_errors_are_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused")

    async def sleep(_: float) -> None:
        return None

    cfg = JudgeConfig(base_url="http://j/v1", model="m", max_retries=1)
    client = JudgeClient(cfg, cache=JudgeCache(), transport=httpx.MockTransport(handler), sleep=sleep)
    rubric = Rubric.model_validate({"items": [{"text": "x"}]})
    with pytest.raises(
        JudgeError, match=re.escape("failed after 2 attempt(s): ConnectError: connection refused")
    ):
        await client.judge(rubric.llm_items, "answer")
    assert calls == 2


async def test_timeout_in_process(mock_judge, rubric: Rubric) -> None:
    client, _app = mock_judge(
        MockJudgeConfig(fault="timeout", hang_s=5, fail_first=1), timeout_s=0.2, max_retries=1
    )
    scores = await client.judge(rubric.llm_items, GOOD)  # first request hangs, the retry answers
    assert scores["irrev"][0][0] == 1.0 and client.stats.retries == 1


def test_timeout_over_a_real_socket(rubric: Rubric) -> None:
    import asyncio

    async def run(base_url: str) -> None:
        cfg = JudgeConfig(base_url=base_url, model="m", timeout_s=0.3, max_retries=0)
        async with JudgeClient(cfg, cache=JudgeCache()) as client:
            with pytest.raises(JudgeError, match=re.escape("failed after 1 attempt(s)")):
                await client.judge(rubric.llm_items, GOOD)

    with serve_in_thread(MockJudgeConfig(fault="timeout", hang_s=3)) as server:
        asyncio.run(run(server.base_url))
        assert server.state.requests == 1


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (
            "garbage",
            "judge answer is not JSON (Expecting value at char 0): 'All criteria look fine to me, full marks!'",
        ),
        ("out_of_range", "judge score for 'stable' is 1.5, outside [0, 1]"),
        ("missing_item", "judge did not score criteria ['wrong']"),
    ],
)
async def test_malformed_answers_are_verifier_errors(
    mock_judge, rubric: Rubric, fault: str, message: str
) -> None:
    client, app = mock_judge(MockJudgeConfig(fault=fault))
    with pytest.raises(VerifierError, match=re.escape(message)):
        await client.judge(rubric.llm_items, GOOD)
    assert app.state.judge.requests == 1  # never retried, never cached
    assert len(client.cache) == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('```json\n{"scores": []}\n```', "judge answer is not JSON"),
        ("[]", 'judge answer must be an object with only a "scores" list'),
        ('{"scores": [], "bonus": 1}', 'judge answer must be an object with only a "scores" list'),
        ('{"scores": [{"id": "a", "score": "1"}]}', "judge score for 'a' is not a number: '1'"),
        ('{"scores": [{"id": "a", "score": true}]}', "judge score for 'a' is not a number: True"),
        ('{"scores": [{"id": "a", "score": NaN}]}', "judge score for 'a' is not a number: nan"),
        ('{"scores": [{"id": "a", "score": -0.1}]}', "judge score for 'a' is -0.1, outside [0, 1]"),
        (
            '{"scores": [{"id": "a", "score": 1}, {"id": "a", "score": 1}]}',
            "judge scored criterion 'a' twice",
        ),
        ('{"scores": [{"id": "zz", "score": 1}]}', "judge scored unknown criterion 'zz'; expected ['a']"),
        ('{"scores": [{"score": 1}]}', 'judge score entry must be an object with a string "id"'),
        (None, "judge answer has no text content (got NoneType)"),
    ],
)
def test_strict_parsing(content: str | None, message: str) -> None:
    with pytest.raises(VerifierError, match=re.escape(message)):
        parse_scores(content, ["a"])


def test_parse_accepts_exact_answer() -> None:
    assert parse_scores(' {"scores": [{"id": "a", "score": 0, "rationale": "no"}]}\n', ["a"]) == {
        "a": (0.0, "no")
    }


async def test_api_key_sent_and_never_leaked(mock_judge, rubric: Rubric, monkeypatch, caplog) -> None:
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("LABRL_TEST_JUDGE_KEY", secret)
    ok, _app = mock_judge(MockJudgeConfig(api_key=secret), api_key_env="LABRL_TEST_JUDGE_KEY")
    assert (await ok.judge(rubric.llm_items, GOOD))["stable"][0][0] == 1.0
    monkeypatch.setenv("LABRL_TEST_JUDGE_KEY", "sk-wrong-key")
    bad, _ = mock_judge(
        MockJudgeConfig(api_key=secret, fault="http_500", fail_first=0), api_key_env="LABRL_TEST_JUDGE_KEY"
    )
    with caplog.at_level(logging.DEBUG), pytest.raises(JudgeError) as info:
        await bad.judge(rubric.llm_items, GOOD)
    assert "HTTP 401" in str(info.value)
    assert "sk-" not in str(info.value) and "sk-" not in caplog.text
    assert "sk-" not in repr(ok) and "sk-" not in ok.config.model_dump_json()


async def test_missing_api_key_env_is_config_error(mock_judge, rubric: Rubric, monkeypatch) -> None:
    monkeypatch.delenv("LABRL_TEST_ABSENT_KEY", raising=False)
    client, _ = mock_judge(api_key_env="LABRL_TEST_ABSENT_KEY")
    with pytest.raises(
        ConfigError, match=re.escape("reads its API key from $LABRL_TEST_ABSENT_KEY, which is not set")
    ):
        await client.judge(rubric.llm_items, GOOD)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"base_url": "localhost:8000"}, "base_url 'localhost:8000' must start with http:// or https://"),
        ({"samples": 0}, "samples"),
        ({"extra_body": {"messages": []}}, "extra_body must not set ['messages']"),
        ({"batch": "all"}, "batch"),
    ],
)
def test_config_validation(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        JudgeConfig(**config)


def test_mock_url_runs_in_process() -> None:
    assert JudgeConfig().url == "http://mock-judge/v1/chat/completions"
    assert (
        JudgeConfig(base_url="https://api.example.com/v1/").url
        == "https://api.example.com/v1/chat/completions"
    )
