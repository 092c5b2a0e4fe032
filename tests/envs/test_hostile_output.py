"""Hostile model output never stops a run: it is the model's invalid_action, parsed in linear time."""

from __future__ import annotations

import json
import re
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labrl import untrusted_text
from labrl.envs import Outcome, make, parse_action, run_episode, scripted_policy
from labrl.envs.sim.common import extract_answer
from labrl.errors import InvalidActionError
from labrl.verifiers import answers
from labrl.verifiers.answers import extract_json

DEEP = "[" * 100_000
LONG_INT = "9" * 5_000

HOSTILE_JSON = {
    "deep_list": DEEP,
    "deep_object": '{"a":' * 50_000,
    "long_int": f'{{"name": "x", "arguments": {{"n": {LONG_INT}}}}}',
    "long_int_bare": LONG_INT,
}


@pytest.mark.parametrize("body", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_parse_action_hostile_tool_call_is_a_parse_error(body):
    action = parse_action(f"<tool_call>{body}</tool_call>")
    assert action.tool_calls == ()
    assert action.parse_error.startswith("tool call 0 is not valid JSON")


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(1, 20_000), opener=st.sampled_from(["[", '{"a":', "[1,"]))
def test_parse_action_never_raises_on_nesting(depth, opener):
    text = "<tool_call>" + opener * depth + "</tool_call>"
    action = parse_action(text)
    assert action.parse_error is not None and action.tool_calls == ()


@pytest.mark.parametrize("body", [DEEP, '{"phases": [' + LONG_INT + "]}"], ids=["deep", "long_int"])
def test_extract_json_hostile_answer_is_invalid_action(body):
    with pytest.raises(InvalidActionError, match="cannot be read"):
        extract_json(f"<answer>{body}</answer>")


@pytest.mark.parametrize(
    "reply",
    [
        f"<tool_call>{DEEP}</tool_call>",
        f"<tool_call>{HOSTILE_JSON['long_int']}</tool_call>",
        f"<answer>{DEEP}</answer>",
        '<answer>{"phases": [' + LONG_INT + "]}</answer>",
        "<answer>" * 16_000,  # 128 KB, never closed
    ],
    ids=["tool_deep", "tool_long_int", "answer_deep", "answer_long_int", "answer_unclosed_128k"],
)
async def test_hostile_reply_ends_episode_as_invalid_action(reply):
    env = make("xrd/phase-id-v0")
    episode = await run_episode(env, env.make_task("train", 0), scripted_policy([reply]))
    assert episode.outcome is Outcome.INVALID_ACTION
    assert episode.reward == env.unwrapped.invalid_action_reward  # penalized, not masked
    assert episode.turns[0].result.info["error"]


class _CountingPattern:
    """Wraps a compiled pattern and adds up how many characters each ``search`` had to look at."""

    def __init__(self, pattern: re.Pattern[str], counter: list[int]) -> None:
        self.pattern, self.counter = pattern, counter

    def search(self, text: str, pos: int = 0):
        match = self.pattern.search(text, pos)
        self.counter[0] += (match.end() if match else len(text)) - pos
        return match


@pytest.mark.parametrize(
    "text",
    ["<answer>" * 16_384, "<answer>x</answer>" * 7_000 + "<answer>" * 8_000, "```" * 40_000 + "<answer>"],
    ids=["unclosed_answers", "closed_then_unclosed", "fences"],
)
def test_tag_blocks_are_found_in_linear_time(monkeypatch, text):
    """Characters inspected by the block search <= 2 x the text (a regex findall inspects ~n^2/16)."""
    counter = [0]
    original = untrusted_text._as_pattern
    monkeypatch.setattr(
        untrusted_text, "_as_pattern", lambda tag, flags: _CountingPattern(original(tag, flags), counter)
    )
    untrusted_text.last_block(text, "<answer>", "</answer>", ignore_case=True)
    assert 0 < counter[0] <= 2 * len(text)
    with pytest.raises(InvalidActionError):
        extract_answer("<answer>" * 16_384)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [1, ' * 13_000,  # every "{" and "[" starts a decode that reads to the end
        '[ "' + "x" * 130_000,  # unterminated string: the decode reads to the end
        "[" * 500 + ' "' + "x" * 128_000,
        '{"a": {"b": ' * 10_000,
    ],
    ids=["open_objects", "unterminated_string", "brackets_then_string", "nested_open"],
)
def test_json_scan_work_is_linear_in_the_reply(text):
    """The fallback scan reads at most SCAN_WORK_FACTOR x the reply, then refuses it as invalid_action."""
    counter = [0]
    with pytest.raises(ValueError):  # InvalidActionError past the budget, else "no JSON value"
        answers._scan(text, counter)
    with pytest.raises(InvalidActionError):
        extract_json(text)
    assert counter[0] <= max(answers.SCAN_WORK_MIN, answers.SCAN_WORK_FACTOR * len(text)) + len(text)


@pytest.mark.parametrize(
    "text",
    [
        "<answer>" + "{" * 20_000 + "x" * 20_000,  # the flood: each decode fails at once
        '{"a" x' * 8_000,  # each decode fails a few characters in
        "{\n" * 20_000,  # and each error counts the lines before it
        '{"a": [1, ' * 13_000,
        '[ "' + "x" * 130_000,
        "[" * 500 + ' "' + "x" * 128_000,
    ],
    ids=[
        "unclosed_braces",
        "keys_without_colons",
        "braces_on_lines",
        "open_objects",
        "unterminated_string",
        "brackets_then_string",
    ],
)
def test_json_scan_hands_the_decoder_linear_text(text):
    """The real cost of the scan: every decode may read, and its error count lines over, the whole
    string it is handed (json.JSONDecodeError counts newlines from its first character), so the
    sum of what the decodes are handed is what the scan costs. Handed the whole text each time,
    the issue's 20k-brace flood summed 8e8 characters (240k braces: 9 s)."""
    handed = 0

    def counting_raw_decode(doc: str, start: int):
        nonlocal handed
        handed += len(doc)
        return untrusted_text.raw_decode(doc, start)

    with mock.patch.object(answers, "raw_decode", counting_raw_decode), pytest.raises(InvalidActionError):
        extract_json(text)
    budget = max(answers.SCAN_WORK_MIN, answers.SCAN_WORK_FACTOR * len(text))
    # per attempt <= 2 * FIRST_WINDOW + 4 * (read + LOOKAHEAD); attempts <= len(text); reads <= budget + len(text)
    per_scan = (2 * answers.FIRST_WINDOW + 4 * answers.LOOKAHEAD) * len(text) + 4 * (budget + len(text))
    assert handed <= 2 * per_scan  # extract_json scans the <answer> block, then the whole reply


def _whole_text_decode(text: str, start: int):
    """The decode the scan made before windows: ``raw_decode`` handed the whole text (positions from ``start``)."""
    try:
        return untrusted_text.raw_decode(text, start)
    except untrusted_text.UntrustedJSONError as exc:
        if exc.pos is None:
            raise
        raise untrusted_text.UntrustedJSONError(exc.msg, exc.pos - start, exc.reached - start) from None


def _outcome(text: str):
    try:
        return ("value", answers._scan(text))
    except ValueError as exc:  # InvalidActionError, or no JSON value
        return (type(exc).__name__, str(exc))


_NOISE = ["{", "}", "[", "]", '"', ":", ",", " ", "\n", "1e", "nul", '"\\u12', "x"]
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text('ab"\\\n{[', max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text("ab", max_size=2), inner, max_size=3),
    max_leaves=8,
)
# JSON values (some cut short) among noise: the answers the scan finds, and the failures it skips
_REPLIES = st.lists(
    st.one_of(
        _JSON_VALUES.map(json.dumps),
        st.tuples(_JSON_VALUES.map(json.dumps), st.integers(0, 40)).map(
            lambda dumped_cut: dumped_cut[0][: dumped_cut[1]]
        ),
        st.sampled_from(_NOISE),
    ),
    max_size=8,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(_REPLIES, st.integers(1, 8))
def test_windowed_decodes_find_what_whole_text_decodes_find(text, first_window):
    """Windows as small as 1 character (doubling) give the scan the same answers as the whole text."""
    with mock.patch.object(answers, "FIRST_WINDOW", first_window):
        windowed = _outcome(text)
    with mock.patch.object(answers, "_decode_at", _whole_text_decode):
        whole = _outcome(text)
    assert windowed == whole


def test_json_scan_still_finds_the_last_value_in_ordinary_replies():
    reply = 'I think {phases: [{"formula": "NaCl"}]} ... so {"phases": [{"formula": "Si"}], } done'
    assert extract_json(reply) == {"phases": [{"formula": "Si"}]}
    counter = [0]
    assert answers._scan('first {"x": [1, 2]} then [3, {"y": 4}]', counter) == [3, {"y": 4}]
    assert counter[0] <= 40


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet='{}[]"<>/answer:,0123456789 \\', max_size=400))
def test_extract_json_raises_only_invalid_action(text):
    try:
        extract_json(text)
    except InvalidActionError:
        pass
