"""HFTokenizer over the tokenizer files the HF export writes: same ids as ByteTokenizer."""

import json
import re

import pytest

from labrl.envs.types import Message, ToolSpec
from labrl.errors import ConfigError
from labrl.harness.models.hf_export import write_tokenizer_files
from labrl.harness.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TOOLS = [
    ToolSpec(name="simulate", description="simulate a pättern"),  # non-ASCII: json.dumps escapes it
    ToolSpec(
        name="submit",
        description="answer",
        parameters={"type": "object", "properties": {"phase": {"type": "string"}}, "required": ["phase"]},
    ),
]
CONVERSATIONS = {
    "user only": ([Message(role="user", content="hi")], []),
    "tools, no system": ([Message(role="user", content="Fe₂O₃?")], TOOLS),
    "system + tools": (
        [Message(role="system", content="be brief"), Message(role="user", content="q\nline 2")],
        TOOLS,
    ),
    "multi-turn": (
        [
            Message(role="user", content="go"),
            Message(role="assistant", content='<tool_call>{"name": "simulate"}</tool_call>'),
            Message(role="tool", content="peaks: 28.4, 47.3", tool_call_id="c1"),
        ],
        TOOLS[:1],
    ),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path)
    return HFTokenizer(str(path)), ByteTokenizer()


def test_protocol_and_special_ids_match(tokenizers):
    hf, byte = tokenizers
    assert isinstance(hf, Tokenizer)
    assert (hf.vocab_size, hf.pad_token_id) == (byte.vocab_size, byte.pad_token_id) == (264, 256)
    assert hf.stop_token_ids == (257, 259) and set(byte.stop_token_ids) == {257, 259}
    assert hf.close_turn([72, 259]) == byte.close_turn([72, 259]) == []
    assert hf.close_turn([72, 105]) == byte.close_turn([72, 105]) == [259]


@pytest.mark.parametrize("text", ["hello", "Fe₂O₃ at 2θ = 28.4°\n\ttab", "", "a <|im_end|> typed"])
def test_text_round_trip_with_byte_ids(tokenizers, text):
    hf, byte = tokenizers
    ids = hf.encode(text)
    assert ids == byte.encode(text) == list(text.encode())  # typed special strings stay bytes
    assert hf.decode(ids) == byte.decode(ids) == text
    with_specials = [256 + 2, *ids, 259]
    assert hf.decode(with_specials) == text
    assert hf.decode(with_specials, skip_special_tokens=False) == f"<|im_start|>{text}<|im_end|>"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_prompt_ids_identical(tokenizers, name):
    hf, byte = tokenizers
    messages, tools = CONVERSATIONS[name]
    ids = hf.chat_prompt(messages, tools)
    assert ids == byte.chat_prompt(messages, tools)
    assert hf.decode(ids, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_continuation_ids_identical(tokenizers):
    hf, byte = tokenizers
    history = [
        Message(role="user", content="go"),
        Message(role="assistant", content="<tool_call>x</tool_call>"),
    ]
    new = [Message(role="tool", content="42"), Message(role="user", content="and?")]
    ids = hf.continuation(history, new, TOOLS)
    assert ids == byte.continuation(history, new, TOOLS)
    assert (
        hf.decode(ids, skip_special_tokens=False)
        == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_missing_dir_and_missing_template_are_config_errors(tmp_path):
    with pytest.raises(
        ConfigError, match=re.escape(f"no Hugging Face tokenizer at {str(tmp_path / 'none')!r}")
    ):
        HFTokenizer(str(tmp_path / "none"))
    write_tokenizer_files(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=re.escape(f"the tokenizer at {str(tmp_path)!r} has no chat_template")
    ):
        HFTokenizer(str(tmp_path))
