"""Rubric-judged question tasks: the JSONL format, its loader, and the split rule.

One task per line::

    {"id": "synth-sol-gel-01", "topic": "synthesis", "question": "...",
     "rubric": [{"text": "...", "weight": 2}, {"kind": "numeric", ...}, ...],
     "reference_answer": "...", "split": "train"}

- ``id``: unique, ``[a-z0-9][a-z0-9_.-]*``; ``topic``: free text (the shipped
  set uses synthesis, characterisation, phase_stability);
- ``rubric``: a list of rubric items (``labrl.verifiers.rubric.items``), or
  ``{"items": [...]}``;
- ``reference_answer`` (optional): an answer meeting every positive item and
  no negative one; it is the env's gold action;
- ``split`` (optional): ``train`` or ``test``; when absent, a task is in
  ``test`` iff ``sha256(id)[0] % 5 == 0`` (about 20 %, stable as tasks are
  added).

Every line is validated; an error names the file, the line and the field.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from labrl.errors import ConfigError
from labrl.verifiers.rubric import Rubric

BUILTIN_TASKS = Path(__file__).parent / "data" / "science_qa.jsonl"


class QATask(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", max_length=96)
    topic: str = Field(min_length=1)
    question: str = Field(min_length=1)
    rubric: Rubric
    reference_answer: str | None = None
    split: Literal["train", "test"] | None = None

    @field_validator("rubric", mode="before")
    @classmethod
    def _list_is_items(cls, value: object) -> object:
        return {"items": value} if isinstance(value, list) else value

    @property
    def resolved_split(self) -> Literal["train", "test"]:
        if self.split is not None:
            return self.split
        return "test" if hashlib.sha256(self.id.encode()).digest()[0] % 5 == 0 else "train"


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(line)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_tasks(lines: list[str], source: str) -> tuple[QATask, ...]:
    """Validate JSONL ``lines``; ``ConfigError("<source>:<line>: ...")`` on the first bad line."""
    tasks: list[QATask] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{source}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}:{lineno}: each line must be a JSON object, got {type(data).__name__}"
            )
        try:
            task = QATask.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"{source}:{lineno}: invalid task: {_describe(exc)}") from None
        if task.id in seen:
            raise ConfigError(
                f"{source}:{lineno}: duplicate task id {task.id!r} (first on line {seen[task.id]})"
            )
        seen[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise ConfigError(f"{source}: no tasks (the file is empty)")
    return tuple(tasks)


@lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> tuple[QATask, ...]:
    return parse_tasks(Path(path).read_text(encoding="utf-8").splitlines(), path)


def load_tasks(path: str | Path | None = None) -> tuple[QATask, ...]:
    """Tasks from ``path`` (the shipped set when None), cached until the file changes."""
    p = Path(path) if path is not None else BUILTIN_TASKS
    try:
        st = p.stat()
    except OSError as exc:
        raise ConfigError(f"tasks file {str(p)!r} cannot be read: {exc.strerror}") from None
    return _load_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)
