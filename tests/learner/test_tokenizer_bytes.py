import re

import pytest

from labrl.envs.types import Message, ToolSpec
from labrl.errors import ConfigError
from labrl.harness.tokenizer import ByteTokenizer, Tokenizer


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 264 and tok.pad_token_id == 256 and tok.stop_token_ids == (259, 257)
    ids = tok.encode("Fe₂O₃ <|im_end|>")
    assert 259 not in ids  # typed special strings stay bytes
    assert tok.decode(ids) == "Fe₂O₃ <|im_end|>"
    assert tok.decode([72, 105, 259], skip_special_tokens=False) == "Hi<|im_end|>"
    assert tok.decode([72, 105, 259]) == "Hi"
    with pytest.raises(
        ConfigError, match=re.escape("token id 300 is outside the byte tokenizer's vocabulary of 264")
    ):
        tok.decode([300])


def test_chat_template_and_continuation_are_exact():
    tok = ByteTokenizer()
    msgs = [Message(role="user", content="hi")]
    prompt = tok.chat_prompt(msgs)
    assert (
        tok.decode(prompt, skip_special_tokens=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    cont = tok.continuation(
        [*msgs, Message(role="assistant", content="x")], [Message(role="tool", content="42")]
    )
    assert (
        tok.decode(cont, skip_special_tokens=False)
        == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.close_turn([1, 259]) == [] and tok.close_turn([1, 2]) == [259]


def test_tools_go_into_a_system_message():
    tok = ByteTokenizer()
    tool = ToolSpec(name="simulate", description="simulate a pattern")
    text = tok.decode(tok.chat_prompt([Message(role="user", content="q")], [tool]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n\n\n# Tools\n")
    assert '"name": "simulate"' in text and text.endswith(
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    )
