"""judged/science-qa-v0: tasks, gold answers, invalid actions, failures, user task files, the checker."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from labrl.envs import Action, Outcome
from labrl.envs.actions import parse_action
from labrl.envs.episode import run_episode, scripted_policy
from labrl.envs.judged import ScienceQAEnv, load_tasks
from labrl.envs.judged.tasks import BUILTIN_TASKS
from labrl.envs.registry import make
from labrl.errors import ConfigError, InvalidActionError, JudgeAuthError
from labrl.verifiers.rubric import JudgeCache, JudgeClient, JudgeConfig, RubricGrader
from labrl.verifiers.rubric.mock_judge import MockJudgeConfig, serve_in_thread

ENV_ID = "judged/science-qa-v0"


def test_shipped_data_shape() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 30
    assert {t.topic for t in tasks} == {"synthesis", "characterisation", "phase_stability"}
    assert {t.resolved_split for t in tasks} == {"train", "test"}
    assert all(t.reference_answer for t in tasks)
    assert all(any(i.polarity == "negative" for i in t.rubric.items) for t in tasks)
    kinds = {i.kind for t in tasks for i in t.rubric.items}
    assert kinds == {"llm", "numeric", "regex", "contains"}


async def test_every_reference_answer_meets_its_rubric_exactly() -> None:
    """Each reference meets every positive item and no negative one (mock judge), so gold = 1.0."""
    async with JudgeClient(JudgeConfig(), cache=JudgeCache()) as client:
        grader = RubricGrader([client])
        for task in load_tasks():
            result = await grader.grade(task.rubric, task.reference_answer or "", task.question)
            wrong = [
                (i.id, i.score) for i in result.items if i.score != (1.0 if i.polarity == "positive" else 0.0)
            ]
            assert (task.id, result.score, wrong) == (task.id, 1.0, [])


async def test_answers_to_other_questions_score_low() -> None:
    async with JudgeClient(JudgeConfig(), cache=JudgeCache()) as client:
        grader = RubricGrader([client])
        tasks = load_tasks()
        scores = [
            (
                await grader.grade(t.rubric, tasks[(k + 1) % len(tasks)].reference_answer or "", t.question)
            ).score
            for k, t in enumerate(tasks)
        ]
    assert max(scores) <= 0.5 and sum(scores) / len(scores) < 0.1


def test_tasks_deterministic_and_splits_disjoint() -> None:
    env = ScienceQAEnv()
    assert env.make_task("train", 3) == env.make_task("train", 3)
    train = {env.make_task("train", s).task_id for s in range(40)}
    test = {env.make_task("test", s).task_id for s in range(40)}
    assert not train & test
    assert len(train) + len(test) == len(env.tasks)  # seeds 0..n-1 visit every task of a split
    assert env.make_task("test", 0).task_id == sorted(test)[0]


async def test_episode_gold_and_info() -> None:
    env = ScienceQAEnv()
    task = env.make_task("test", 1)
    obs = await env.reset(task)
    assert [m.role for m in obs.messages] == ["system", "user"] and obs.messages[1].content == task.prompt[
        "question"
    ]
    (gold,) = env.gold_actions(task)
    result = await env.step(gold)
    assert result.done and result.outcome is Outcome.OK and result.reward == 1.0
    items = result.info["rubric"]["items"]
    assert len(items) == task.metadata["n_items"]
    assert all(i["score"] == (1.0 if i["polarity"] == "positive" else 0.0) for i in items)
    await env.close()


async def test_partial_answer_hand_computed() -> None:
    env = ScienceQAEnv()
    task = next(
        env.make_task("train", s)
        for s in range(40)
        if env.make_task("train", s).task_id == "phase-tio2-polymorphs"
    )
    await env.reset(task)
    # rutile stable (2) + irreversible (2); no temperature, size, dopants, brookite; negative item not met
    result = await env.step(
        Action(text="Rutile is the stable phase and the anatase to rutile change is irreversible.")
    )
    assert result.reward == pytest.approx(4 / 8)  # positive weights 2+2+1+1+1+1 = 8
    await env.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the answer is empty: answer the question in prose"),
        ("   \n\t", "the answer is empty: answer the question in prose"),
        ("\x00\x01\x02\x7f", "the answer has 0 word(s); write at least 3 words of prose"),
        ("42 !!", "the answer has 0 word(s); write at least 3 words of prose"),
        (
            '<tool_call>{"name": "x", "arguments": {}}</tool_call>',
            "this task offers no tools: answer the question in prose",
        ),
        (
            "<tool_call>{not json</tool_call>",
            "your answer contains a malformed tool call (tool call 0 is not valid JSON",
        ),
    ],
)
async def test_invalid_actions(text: str, message: str) -> None:
    env = ScienceQAEnv()
    await env.reset(env.make_task("train", 0))
    with pytest.raises(InvalidActionError, match=re.escape(message)):
        await env.step(parse_action(text))


async def test_too_long_answer_is_invalid() -> None:
    env = ScienceQAEnv(max_answer_chars=50)
    await env.reset(env.make_task("train", 0))
    with pytest.raises(InvalidActionError, match=re.escape("the answer has 59 characters; the limit is 50")):
        await env.step(Action(text="word " * 12))  # 60 characters, trailing space stripped


async def test_through_make_garbage_is_invalid_action_not_a_score() -> None:
    env = make(ENV_ID)
    await env.reset(env.make_task("train", 0))
    result = await env.step(parse_action("{"))
    assert result.outcome is Outcome.INVALID_ACTION and result.reward == 0.0 and result.done
    await env.close()


@pytest.mark.parametrize("fault", ["garbage", "out_of_range", "missing_item", "http_500"])
async def test_judge_failures_are_verifier_failed(fault: str) -> None:
    with serve_in_thread(MockJudgeConfig(fault=fault)) as server:
        judge = {
            "base_url": server.base_url,
            "model": f"m-{fault}",
            "max_retries": 1,
            "backoff_s": 0,
            "cache": False,
        }
        env = make(ENV_ID, judges=[judge])
        task = env.make_task("train", 2)
        await env.reset(task)
        result = await env.step(env.gold_actions(task)[0])
        await env.close()
    assert result.outcome is Outcome.VERIFIER_FAILED and result.reward is None and result.done
    assert f"judge 'm-{fault}'" in result.info["error"]


async def test_judge_refusing_the_key_stops_the_episode(monkeypatch) -> None:
    """A real judge on localhost answering 401: the episode raises (the run stops with that one line),
    where it used to be verifier_failed and the run went on failing every episode."""
    monkeypatch.setenv("LABRL_TEST_JUDGE_KEY", "sk-wrong-key")
    with serve_in_thread(MockJudgeConfig(api_key="sk-right-key")) as server:
        judge = {
            "base_url": server.base_url,
            "model": "m",
            "api_key_env": "LABRL_TEST_JUDGE_KEY",
            "cache": False,
        }
        env = make(ENV_ID, judges=[judge])
        task = env.make_task("train", 2)
        try:
            with pytest.raises(
                JudgeAuthError, match=re.escape("refused the credentials in $LABRL_TEST_JUDGE_KEY: HTTP 401")
            ):
                await run_episode(env, task, scripted_policy(list(env.gold_actions(task))))
        finally:
            await env.close()
        assert server.state.requests == 1  # not retried


async def test_real_socket_judge_and_random_action() -> None:
    with serve_in_thread() as server:
        env = make(
            ENV_ID,
            judges=[{"base_url": server.base_url, "model": "m", "cache": False}, {}],
            aggregate="median",
        )
        task = env.make_task("train", 5)
        await env.reset(task)
        action = env.random_action(task, random.Random(0))
        assert (
            action == env.random_action(task, random.Random(0))
            and action.text != task.answer["reference_answer"]
        )
        result = await env.step(action)
        await env.close()
        assert server.state.requests == 1
    assert result.outcome is Outcome.OK and 0.0 <= result.reward < 1.0
    assert result.info["rubric"]["judges"] == ["m", "mock-keyword-judge"]
    assert result.info["rubric"]["disagreement"]["members"] == 2


def test_bad_options_name_the_field() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("judged/science-qa-v0: invalid option(s): judges.0.base_url")
    ):
        ScienceQAEnv(judges=[{"base_url": "ftp://x"}])
    with pytest.raises(
        ConfigError, match=re.escape("does not accept option(s) 'judge' (did you mean 'judges'?)")
    ):
        make(ENV_ID, judge={})


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD_LINE = json.dumps(
    {
        "id": "my-q1",
        "topic": "electrochemistry",
        "question": "What limits the rate capability of LiFePO4?",
        "rubric": [
            {"text": "Mentions low `electronic conductivity`"},
            {"text": "Says `carbon coating` helps"},
        ],
        "reference_answer": "Its low electronic conductivity; a carbon coating and small particles help.",
        "split": "train",
    }
)


async def test_user_task_file(tmp_path: Path) -> None:
    other = json.loads(GOOD_LINE) | {"id": "my-q2", "split": "test"}
    env = ScienceQAEnv(tasks_path=str(_write(tmp_path, [GOOD_LINE, "", json.dumps(other)])))
    assert [t.id for t in env.tasks] == ["my-q1", "my-q2"]
    task = env.make_task("train", 7)
    assert task.task_id == "my-q1"
    await env.reset(task)
    assert (await env.step(env.gold_actions(task)[0])).reward == 1.0


def test_hash_split_when_absent(tmp_path: Path) -> None:
    lines = [json.dumps(json.loads(GOOD_LINE) | {"id": f"q{k}", "split": None}) for k in range(40)]
    tasks = load_tasks(_write(tmp_path, lines))
    test = {t.id for t in tasks if t.resolved_split == "test"}
    assert 0 < len(test) < 20 and test == {
        t.id for t in load_tasks(_write(tmp_path, lines)) if t.resolved_split == "test"
    }


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            "{not json",
            "tasks.jsonl:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        ),
        ("[1, 2]", "tasks.jsonl:2: each line must be a JSON object, got list"),
        (
            json.dumps({"id": "x"}),
            "tasks.jsonl:2: invalid task: topic: Field required; question: Field required",
        ),
        (
            json.dumps(
                json.loads(GOOD_LINE)
                | {
                    "id": "x2",
                    "rubric": [
                        {"text": "t", "kind": "numeric", "value": 1, "tolerance": 1, "units": "parsecz"}
                    ],
                }
            ),
            "tasks.jsonl:2: invalid task: rubric.items.0.numeric.units: Value error, unknown unit 'parsecz'",
        ),
        (GOOD_LINE, "tasks.jsonl:2: duplicate task id 'my-q1' (first on line 1)"),
        (
            json.dumps(json.loads(GOOD_LINE) | {"id": "Bad Id"}),
            "tasks.jsonl:2: invalid task: id: String should match pattern",
        ),
    ],
)
def test_bad_task_files_name_the_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [GOOD_LINE, bad])
    with pytest.raises(ConfigError, match=re.escape(message)):
        ScienceQAEnv(tasks_path=str(path))


def test_missing_task_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("cannot be read: No such file or directory")):
        load_tasks(tmp_path / "nope.jsonl")


def test_empty_split_is_config_error(tmp_path: Path) -> None:
    env = ScienceQAEnv(tasks_path=str(_write(tmp_path, [GOOD_LINE])))
    with pytest.raises(ConfigError, match=re.escape("judged/science-qa-v0: split 'test' has no tasks in")):
        env.make_task("test", 0)


def test_check_env_passes() -> None:
    from labrl.envs.checker import check_env

    report = check_env(ENV_ID)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert {c.name for c in report.checks} >= {"gold", "invalid_action", "timeout", "determinism", "splits"}


def test_cli_validate_and_check(tmp_path: Path, capsys) -> None:
    from labrl.cli import main

    assert main(["judge", "validate", str(BUILTIN_TASKS)]) == 0
    assert "33 valid tasks" in capsys.readouterr().out
    assert main(["judge", "validate", str(_write(tmp_path, [GOOD_LINE, "[]"]))]) == 2
    assert "tasks.jsonl:2: each line must be a JSON object, got list" in capsys.readouterr().err
    assert main(["envs", "check", ENV_ID]) == 0
