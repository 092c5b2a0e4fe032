"""Parse a model's phase-identification answer into library phases.

Accepted forms (also listed in docs/xrd.md):

- a candidate letter when the prompt lists candidates: ``B``, ``(B)``,
  ``Answer: B``, ``<answer>B</answer>``, or ``{"answer": "B"}``;
- JSON anywhere in the text (see ``labrl.verifiers.answers.extract_json``)::

      {"phases": [{"formula": "NaCl", "space_group": "Fm-3m", "weight_fraction": 0.6},
                  {"formula": "Si", "space_group": 227, "weight_fraction": 0.4}]}

  also a bare list of phase objects, one phase object, or strings in place of
  objects (a phase id ``"NaCl_225"``, a formula, or a candidate letter). Keys:
  ``formula`` (or ``phase``/``id``), ``space_group`` (or ``spacegroup``/``sg``,
  a number or a Hermann–Mauguin symbol), ``weight_fraction`` (or ``weight``/
  ``wt``/``fraction``; percentages are accepted when they sum to ~100);
- a bare formula, optionally with a space group: ``NaCl`` or ``NaCl Fm-3m``.

The space group may be left out when the formula identifies one phase (among
the candidates, when there are candidates). Anything else raises
``InvalidActionError`` with a message the model can act on.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from labrl.errors import InvalidActionError
from labrl.verifiers.answers import extract_choice, extract_json
from labrl.verifiers.xrd.formula import composition_key
from labrl.verifiers.xrd.library import Phase, PhaseLibrary

FORMAT_HINT = (
    'Answer with JSON like {"phases": [{"formula": "NaCl", "space_group": 225, "weight_fraction": 1.0}]}'
)
_BARE = re.compile(r"^\s*([A-Z][A-Za-z0-9().]*)(?:\s+(?:sg\s*)?([A-Za-z0-9\-/_ ]{1,20}))?\s*$")
_KEYS_FORMULA = ("formula", "phase", "id", "name")
_KEYS_SG = ("space_group", "spacegroup", "sg", "space_group_number", "spacegroup_number")
_KEYS_WEIGHT = ("weight_fraction", "weight", "wt", "fraction", "wf")


@dataclass(frozen=True)
class ClaimedPhase:
    phase: Phase
    weight_fraction: float | None = None


def _norm_symbol(symbol: str) -> str:
    return re.sub(r"[\s_]", "", symbol).lower()


def _resolve(
    library: PhaseLibrary,
    name: str,
    space_group: Any,
    candidates: dict[str, str] | None,
) -> Phase:
    if candidates and name in candidates and space_group is None:
        return library.get(candidates[name])
    if name in library and space_group is None:
        return library.get(name)
    try:
        matches = library.by_formula(name)
    except InvalidActionError as exc:
        raise InvalidActionError(f"{exc}. {FORMAT_HINT}") from None
    if candidates:
        allowed = set(candidates.values())
        matches = [p for p in matches if p.id in allowed]
        if not matches:
            listed = ", ".join(f"{k}) {library.get(v).formula}" for k, v in candidates.items())
            raise InvalidActionError(f"{name!r} is not one of the candidates: {listed}")
    if not matches:
        raise InvalidActionError(f"no phase with formula {name!r} in the phase library")
    if space_group is not None and space_group != "":
        if isinstance(space_group, bool):
            raise InvalidActionError(f"space group must be a number or a symbol, got {space_group!r}")
        if isinstance(space_group, int | float) or (
            isinstance(space_group, str) and space_group.strip().isdigit()
        ):
            value = float(space_group)  # 1e999 and "9" * 400 are inf: int() of it would raise OverflowError
            if not (math.isfinite(value) and value.is_integer() and 1 <= value <= 230):
                raise InvalidActionError(
                    f"space group number must be an integer in 1..230, got {repr(space_group)[:40]}"
                )
            number = int(value)
            chosen = [p for p in matches if p.spacegroup_number == number]
        elif isinstance(space_group, str):
            chosen = [p for p in matches if _norm_symbol(p.spacegroup_symbol) == _norm_symbol(space_group)]
        else:
            raise InvalidActionError(f"space group must be a number or a symbol, got {space_group!r}")
        if not chosen:
            known = ", ".join(f"{p.spacegroup_symbol} ({p.spacegroup_number})" for p in matches)
            raise InvalidActionError(
                f"{name} with space group {space_group!r} is not in the phase library; known: {known}"
            )
        return chosen[0]
    if len(matches) > 1:
        known = ", ".join(f"{p.spacegroup_symbol} ({p.spacegroup_number})" for p in matches)
        raise InvalidActionError(f"{name} is ambiguous: give its space group, one of {known}")
    return matches[0]


def _weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidActionError(f"weight fraction must be a number, got {value!r}")
    try:
        number = float(str(value).strip().rstrip("%"))
    except ValueError:
        raise InvalidActionError(f"weight fraction must be a number, got {value!r}") from None
    if not 0 <= number <= 100:
        raise InvalidActionError(f"weight fraction must be between 0 and 1 (or 0 and 100 %), got {value!r}")
    return number


def _item(library: PhaseLibrary, item: Any, candidates: dict[str, str] | None) -> tuple[Phase, float | None]:
    if isinstance(item, str):
        return _resolve(library, item.strip(), None, candidates), None
    if not isinstance(item, dict):
        raise InvalidActionError(f"each phase must be an object or a string, got {item!r}. {FORMAT_HINT}")
    name = next((item[k] for k in _KEYS_FORMULA if k in item), None)
    if not isinstance(name, str) or not name.strip():
        raise InvalidActionError(f'each phase needs a "formula" string, got {item!r}. {FORMAT_HINT}')
    sg = next((item[k] for k in _KEYS_SG if k in item), None)
    weight = next((item[k] for k in _KEYS_WEIGHT if k in item), None)
    return _resolve(library, name.strip(), sg, candidates), (None if weight is None else _weight(weight))


def parse_answer(
    text: str,
    library: PhaseLibrary,
    *,
    candidates: dict[str, str] | None = None,
    max_phases: int = 5,
) -> list[ClaimedPhase]:
    """The phases (and weight fractions, normalised to sum 1 when all given) named in ``text``."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidActionError(f"empty answer. {FORMAT_HINT}")
    if candidates:
        letter = extract_choice(text, "".join(candidates))
        if letter is not None and "{" not in text and "[" not in text:
            return [ClaimedPhase(library.get(candidates[letter]))]
    try:
        payload = extract_json(text, hint=FORMAT_HINT)
    except InvalidActionError:
        bare = _BARE.match(text)
        if bare is None:
            raise
        try:
            composition_key(bare.group(1))
        except InvalidActionError:
            raise InvalidActionError(f"could not read an answer from the reply. {FORMAT_HINT}") from None
        return [ClaimedPhase(_resolve(library, bare.group(1), bare.group(2), candidates))]
    if isinstance(payload, dict):
        if "phases" in payload:
            payload = payload["phases"]
        elif "answer" in payload:
            payload = payload["answer"]
            payload = payload if isinstance(payload, list) else [payload]
        else:
            payload = [payload]
    if not isinstance(payload, list) or not payload:
        raise InvalidActionError(f'"phases" must be a non-empty list. {FORMAT_HINT}')
    if len(payload) > max_phases:
        raise InvalidActionError(f"at most {max_phases} phases may be claimed, got {len(payload)}")
    items = [_item(library, it, candidates) for it in payload]
    ids = [p.id for p, _ in items]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise InvalidActionError(f"phase(s) listed more than once: {duplicates}")
    weights = [w for _, w in items]
    if all(w is not None for w in weights):
        total = sum(weights)  # type: ignore[arg-type]
        if total <= 0:
            raise InvalidActionError("weight fractions must not all be zero")
        if total > 1.5 and abs(total - 100) > 5:
            raise InvalidActionError(f"weight fractions must sum to 1 (or 100 %), got {total:g}")
        return [ClaimedPhase(p, w / total) for p, w in items]  # type: ignore[operator]
    return [ClaimedPhase(p, None) for p, _ in items]
