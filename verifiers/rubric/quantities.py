"""Find physical quantities in free text and compare them through pint.

``find_quantities(text)`` returns every number in ``text`` with the unit
strings after it that pint knows: ``"calcined at 873 K for 2 h"`` ->
``[(873.0, ["K"], 12), (2.0, ["h"], 22)]``. Numbers may use thousands separators
(``1,000``), exponents (``1e-3``, ``1.2 × 10^5``) and a unit of up to two
tokens (``g/cm^3``, ``kJ mol^-1``).

``matches(text, value, tolerance, units)``: some quantity in the text, once
converted to ``units``, lies within ``tolerance`` of ``value``. An item with
units needs a quantity whose unit converts (a bare number never matches it);
an item without units compares the numbers alone, ignoring any word after
them (prose words such as "in" or "a" are pint units too). ``C`` after a
number is read as degrees Celsius when the item's units are a temperature
(pint would read coulomb).
"""

from __future__ import annotations

import functools
import re
from typing import Any

_NUMBER = r"(?P<num>[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_POWER = r"(?:\s*[x×]\s*10\^?(?P<exp>[-+−]?\d+))?"
_UNIT_TOKEN = r"[A-Za-zÅ°µμΩ%][A-Za-zÅ°µμΩ%0-9^·*/\-−]*"
_UNIT = rf"(?:\s?(?P<unit>{_UNIT_TOKEN}(?:\s(?:{_UNIT_TOKEN}))?))?"
_QUANTITY = re.compile(rf"(?<![\w.]){_NUMBER}{_POWER}{_UNIT}")
_ALIASES = {"℃": "degC", "°K": "kelvin", "º C": "degC", "ºC": "degC"}
ANCHOR_WINDOW = 80


@functools.cache
def _registry() -> Any:
    import pint

    return pint.UnitRegistry()


def parse_units(units: str) -> Any:
    """pint units for ``units``; ``ValueError`` naming it when pint does not know it."""
    try:
        return _registry().parse_units(_ALIASES.get(units, units).replace("−", "-"))
    except Exception as exc:  # pint raises several unrelated types for bad unit strings
        raise ValueError(f"unknown unit {units!r} ({type(exc).__name__})") from None


def _to_float(number: str, exponent: str | None) -> float:
    value = float(number.replace(",", "").replace("−", "-"))
    if exponent:
        value *= 10.0 ** int(exponent.replace("−", "-"))
    return value


def _unit_candidates(raw: str | None) -> list[str]:
    """Longest first: ``"K for"`` -> ``["K for", "K"]`` (the second token is often a plain word)."""
    if not raw:
        return []
    raw = raw.rstrip(".,;:)")
    parts = raw.split(" ")
    return [" ".join(parts[:n]) for n in range(len(parts), 0, -1)]


def find_quantities(text: str) -> list[tuple[float, list[str], int]]:
    """``(value, unit candidates, start offset)`` for every number in ``text``.

    Candidates are the one- or two-token strings after the number that pint
    parses, longest first (``"°C in air"`` -> ``["°C in", "°C"]``: prose words
    can be units too, so the caller keeps the first that converts).
    """
    found = []
    for m in _QUANTITY.finditer(text):
        units = []
        for candidate in _unit_candidates(m["unit"]):
            try:
                parse_units(candidate)
            except ValueError:
                continue
            units.append(candidate)
        found.append((_to_float(m["num"], m["exp"]), units, m.start()))
    return found


def _convert(value: float, units: list[str], target: str) -> float | None:
    """``value`` in the first of ``units`` that converts to ``target``, or None when none does."""
    ureg = _registry()
    target_units = parse_units(target)
    for unit in units:
        if unit == "C" and target_units.dimensionality == ureg.kelvin.dimensionality:
            unit = "degC"
        try:
            return float(ureg.Quantity(value, parse_units(unit)).to(target_units).magnitude)
        except Exception:  # DimensionalityError and offset-unit errors: not comparable
            continue
    return None


def matches(text: str, value: float, tolerance: float, units: str | None, anchor: str | None = None) -> bool:
    """Some quantity in ``text`` equals ``value ± tolerance`` in ``units`` (after an ``anchor`` match, if set)."""
    windows: list[tuple[int, int]] | None = None
    if anchor is not None:
        windows = [(m.end(), m.end() + ANCHOR_WINDOW) for m in re.finditer(anchor, text, re.IGNORECASE)]
        if not windows:
            return False
    for quantity, candidates, start in find_quantities(text):
        if windows is not None and not any(lo <= start <= hi for lo, hi in windows):
            continue
        converted = quantity if units is None else _convert(quantity, candidates, units)
        if converted is not None and abs(converted - value) <= tolerance + 1e-9 * max(1.0, abs(value)):
            return True
    return False
