"""Rubric items and rubrics: what a response is graded against.

A ``Rubric`` is a list of weighted items. Each item has a polarity
(``positive``: a quality the answer should have; ``negative``: a fault it
should not have) and a kind that says how it is scored:

- ``llm``: judged by one or more LLM judges (``labrl.verifiers.rubric.judge``);
  the judge returns a score in [0, 1] for "how fully the response exhibits
  this criterion", whatever its polarity.
- ``regex``: 1 if ``pattern`` matches anywhere in the response, else 0.
- ``contains``: 1 if the response contains ``all`` (or ``any``) of ``terms``.
- ``numeric``: 1 if a quantity in the response is within ``tolerance`` of
  ``value`` (both in ``units``, converted through pint), else 0.

Key terms for the mock judge: the text of an ``llm`` item may mark key terms in
backticks, with ``|`` between alternatives, e.g. ``"Names `rutile|TiO2 rutile`
as the high-temperature polymorph"``. Real judges read them as emphasis; the
CI mock judge scores an item 1 exactly when every backticked group has at
least one alternative in the response (see ``key_term_groups``).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ITEM_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
_KEY_TERMS = re.compile(r"`([^`]+)`")


class _ItemBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str | None = Field(default=None, pattern=ITEM_ID_PATTERN)
    text: str = Field(min_length=1, description="the criterion, as a judge or a human would read it")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    polarity: Literal["positive", "negative"] = "positive"


class LLMItem(_ItemBase):
    kind: Literal["llm"] = "llm"


class RegexItem(_ItemBase):
    kind: Literal["regex"]
    pattern: str = Field(min_length=1)
    ignore_case: bool = True

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
        return pattern


class ContainsItem(_ItemBase):
    kind: Literal["contains"]
    terms: tuple[str, ...] = Field(min_length=1)
    match: Literal["all", "any"] = "all"
    ignore_case: bool = True

    @field_validator("terms")
    @classmethod
    def _non_empty_terms(cls, terms: tuple[str, ...]) -> tuple[str, ...]:
        if any(not t.strip() for t in terms):
            raise ValueError("terms must not contain empty strings")
        return terms


class NumericItem(_ItemBase):
    kind: Literal["numeric"]
    value: float = Field(allow_inf_nan=False)
    tolerance: float = Field(ge=0, allow_inf_nan=False, description="absolute, in `units`")
    units: str | None = Field(default=None, description="pint unit string; None for a bare number")
    anchor: str | None = Field(
        default=None,
        description="regex; when set, only quantities within 80 characters after a match count",
    )

    @field_validator("units")
    @classmethod
    def _known_units(cls, units: str | None) -> str | None:
        if units is None:
            return None
        from labrl.verifiers.rubric.quantities import parse_units

        parse_units(units)  # raises ValueError naming the unit
        return units

    @field_validator("anchor")
    @classmethod
    def _anchor_compiles(cls, anchor: str | None) -> str | None:
        if anchor is not None:
            try:
                re.compile(anchor)
            except re.error as exc:
                raise ValueError(f"anchor {anchor!r} is not a valid regular expression: {exc}") from None
        return anchor


RubricItem = Annotated[LLMItem | RegexItem | ContainsItem | NumericItem, Field(discriminator="kind")]


def key_term_groups(text: str) -> list[tuple[str, ...]]:
    """The backticked key-term groups of an item text: ``"`a|b` and `c`"`` -> ``[("a", "b"), ("c",)]``."""
    groups = []
    for raw in _KEY_TERMS.findall(text):
        alternatives = tuple(t.strip() for t in raw.split("|") if t.strip())
        if alternatives:
            groups.append(alternatives)
    return groups


class Rubric(BaseModel):
    """Weighted items; at least one positive item (the score is normalised by their weight).

    Items without an ``id`` get ``i0``, ``i1``... by position; ids must be unique.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    items: tuple[RubricItem, ...] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _default_ids(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("items"), list | tuple):
            items = []
            for index, item in enumerate(data["items"]):
                if isinstance(item, dict):
                    item = dict(item)
                    item.setdefault("kind", "llm")
                    if item.get("id") is None:
                        item["id"] = f"i{index}"
                elif isinstance(item, _ItemBase) and item.id is None:
                    item = item.model_copy(update={"id": f"i{index}"})
                items.append(item)
            data = {**data, "items": items}
        return data

    @model_validator(mode="after")
    def _checks(self) -> Rubric:
        seen: set[str] = set()
        for item in self.items:
            assert item.id is not None  # filled in by _default_ids
            if item.id in seen:
                raise ValueError(f"duplicate item id {item.id!r}: item ids must be unique within a rubric")
            seen.add(item.id)
        if not any(item.polarity == "positive" for item in self.items):
            raise ValueError(
                "a rubric needs at least one positive item (the score is normalised by their weight)"
            )
        return self

    @property
    def positive_weight(self) -> float:
        return sum(item.weight for item in self.items if item.polarity == "positive")

    @property
    def llm_items(self) -> tuple[LLMItem, ...]:
        return tuple(item for item in self.items if isinstance(item, LLMItem))
