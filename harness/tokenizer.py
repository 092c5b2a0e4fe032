"""Tokenizers behind one protocol: a byte-level one for from-scratch models, HF for real ones.

The rollout builds a conversation token by token and needs two operations
that keep the tokens the model generated untouched (retokenising generated
text can change it, which would break behaviour log-probs):

- ``chat_prompt(messages, tools)``: the whole conversation so far, followed
  by the generation prompt of an assistant turn;
- ``continuation(history, new_messages, tools)``: the tokens that close the
  model's turn and append ``new_messages`` (tool results, user replies) and
  the next generation prompt, given that ``history`` (ending in the
  assistant's message) is already tokenised.

``ByteTokenizer`` uses ChatML over raw UTF-8 bytes (ids 0-255) with eight
special tokens (ids 256-263), so ``vocab_size`` is 264::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n

Text is never parsed for special-token strings: a user who types
``<|im_end|>`` gets bytes, not a turn boundary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from labrl.envs.types import Message, ToolSpec
from labrl.errors import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> list[int]: ...

    def continuation(
        self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[ToolSpec] = ()
    ) -> list[int]: ...

    def close_turn(self, generated: Sequence[int]) -> list[int]: ...


SPECIAL_TOKENS = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
    "<|reserved_3|>",
)


def tools_system_text(tools: Sequence[ToolSpec]) -> str:
    """The tool block appended to the system message (Hermes/Qwen style)."""
    lines = [json.dumps(t.model_dump(), sort_keys=True) for t in tools]
    return (
        "\n\n# Tools\nYou may call one or more functions. Available tools:\n<tools>\n"
        + "\n".join(lines)
        + '\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    )


class ByteTokenizer:
    """UTF-8 bytes plus ChatML special tokens; see the module docstring."""

    def __init__(self) -> None:
        self._special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.im_start_id = self._special["<|im_start|>"]
        self.im_end_id = self._special["<|im_end|>"]
        self.eos_token_id = self._special["<|endoftext|>"]

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    @property
    def pad_token_id(self) -> int:
        return self._special["<|pad|>"]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.im_end_id, self.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif 256 <= i < self.vocab_size:
                if not skip_special_tokens:
                    out.extend(SPECIAL_TOKENS[i - 256].encode())
            else:
                raise ConfigError(
                    f"token id {i} is outside the byte tokenizer's vocabulary of {self.vocab_size}"
                )
        return out.decode("utf-8", errors="replace")

    def _message(self, message: Message, tools: Sequence[ToolSpec]) -> list[int]:
        content = message.content
        if message.role == "system" and tools:
            content += tools_system_text(tools)
        return [
            self.im_start_id,
            *self.encode(f"{message.role}\n{content}"),
            self.im_end_id,
            *self.encode("\n"),
        ]

    def _generation_prompt(self) -> list[int]:
        return [self.im_start_id, *self.encode("assistant\n")]

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> list[int]:
        ids: list[int] = []
        has_system = bool(messages) and messages[0].role == "system"
        if tools and not has_system:
            ids += self._message(Message(role="system", content=""), tools)
        for m in messages:
            ids += self._message(m, tools)
        return ids + self._generation_prompt()

    def continuation(
        self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[ToolSpec] = ()
    ) -> list[int]:
        # The model's turn ended with <|im_end|> (a stop token, already in the
        # conversation); the template's newline after it is ours to add.
        ids = self.encode("\n")
        for m in new_messages:
            ids += self._message(m, tools)
        return ids + self._generation_prompt()

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        """Tokens needed after a turn that stopped without <|im_end|> (hit max tokens)."""
        return [] if generated and generated[-1] in self.stop_token_ids else [self.im_end_id]


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from a hub).

    ``continuation`` renders the conversation with and without the new
    messages and takes the difference; a chat template that rewrites earlier
    turns (so the shorter rendering is not a prefix of the longer) is refused.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except OSError as exc:
            raise ConfigError(f"no Hugging Face tokenizer at {path!r}: {exc}") from exc
        if self._tok.chat_template is None:
            raise ConfigError(f"the tokenizer at {path!r} has no chat_template")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(pad if pad is not None else self._tok.eos_token_id)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        ids = {self._tok.eos_token_id}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = self._tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != self._tok.unk_token_id:
                ids.add(tid)
        return tuple(sorted(i for i in ids if i is not None))

    def encode(self, text: str) -> list[int]:
        # like ByteTokenizer: typed special-token strings stay text, never turn boundaries
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _render(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec], generation_prompt: bool
    ) -> list[int]:
        out = self._tok.apply_chat_template(
            [m.model_dump(exclude_none=True) for m in messages],
            tools=[{"type": "function", "function": t.model_dump()} for t in tools] or None,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return list(out)

    def chat_prompt(self, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> list[int]:
        return self._render(messages, tools, True)

    def continuation(
        self, history: Sequence[Message], new_messages: Sequence[Message], tools: Sequence[ToolSpec] = ()
    ) -> list[int]:
        before = self._render(history, tools, False)
        after = self._render([*history, *new_messages], tools, True)
        if after[: len(before)] != before:
            raise ConfigError(
                "this chat template rewrites earlier turns when new messages arrive, so generated tokens "
                "cannot be kept verbatim: use a template that only appends"
            )
        # The model generated its turn up to the end-of-turn token; whatever
        # the template puts after that token (a newline) is ours to add.
        stops = set(self.stop_token_ids)
        last_stop = max((i for i, t in enumerate(before) if t in stops), default=len(before) - 1)
        return before[last_stop + 1 :] + after[len(before) :]

    def close_turn(self, generated: Sequence[int]) -> list[int]:
        return [] if generated and generated[-1] in self.stop_token_ids else [int(self._tok.eos_token_id)]
