from __future__ import annotations

from labrl.envs import format_tool_call, parse_action


def test_parses_tool_calls_with_positional_ids():
    text = (
        "let me see "
        + format_tool_call("simulate", {"phase_id": "p1"})
        + " and "
        + format_tool_call("fit", {"ids": [1, 2]})
    )
    action = parse_action(text)
    assert action.parse_error is None
    assert [(c.id, c.name, c.arguments) for c in action.tool_calls] == [
        ("call_0", "simulate", {"phase_id": "p1"}),
        ("call_1", "fit", {"ids": [1, 2]}),
    ]
    assert parse_action(text) == action


def test_plain_text_has_no_calls_and_no_error():
    action = parse_action("The answer is rutile.")
    assert action.tool_calls == () and action.parse_error is None


def test_malformed_calls_are_reported_not_raised():
    assert parse_action("<tool_call>{bad</tool_call>").parse_error.startswith("tool call 0 is not valid JSON")
    assert (
        parse_action('<tool_call>{"name": 3}</tool_call>').parse_error
        == 'tool call 0 must be an object with a string "name"'
    )
    assert parse_action('<tool_call>{"name": "f", "arguments": [1]}</tool_call>').parse_error == (
        'tool call 0: "arguments" must be an object, got list'
    )
    unclosed = parse_action('<tool_call>{"name": "f"}')
    assert (
        unclosed.parse_error == "tool call 0 is missing its closing </tool_call>"
        and unclosed.tool_calls == ()
    )
