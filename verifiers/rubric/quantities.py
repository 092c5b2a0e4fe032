"""Find physical quantities in free text and compare them through pint.

``find_quantities(text)`` returns every number in ``text`` with the unit that
follows it (if pint knows it): ``"calcined at 873 K for 2 h"`` ->
``[(873.0, "K"), (2.0, "h")]``. Numbers may use thousands separators
(``1,000``), exponents (``1e-3``, ``1.2 × 10^5``) and a unit of up to two
tokens (``g/cm^3``, ``kJ mol^-1``).

``matches(text, value, tolerance, units)``: some quantity in the text, once
converted to ``units``, lies within ``tolerance`` of ``value``. A bare number
matches only a unit-less item; ``C`` after a number is read as degrees
Celsius when the item's units are a temperature (pint would read coulomb).
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


def find_quantities(text: str) -> list[tuple[float, str | None, int]]:
    """``(value, unit or None, start offset)`` for every number in ``text``."""
    found = []
    for m in _QUANTITY.finditer(text):
        value = _to_float(m["num"], m["exp"])
        unit = None
        for candidate in _unit_candidates(m["unit"]):
            try:
                parse_units(candidate)
            except ValueError:
                continue
            unit = candidate
            break
        found.append((value, unit, m.start()))
    return found


def _convert(value: float, unit: str | None, target: str | None) -> float | None:
    """``value unit`` expressed in ``target``, or None when the two are not comparable."""
    if target is None:
        return value if unit is None else None
    if unit is None:
        return None
    ureg = _registry()
    target_units = parse_units(target)
    candidates = [unit]
    if unit == "C" and target_units.dimensionality == ureg.kelvin.dimensionality:
        candidates = ["degC"]
    for candidate in candidates:
        try:
            return float(ureg.Quantity(value, parse_units(candidate)).to(target_units).magnitude)
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
    for quantity, unit, start in find_quantities(text):
        if windows is not None and not any(lo <= start <= hi for lo, hi in windows):
            continue
        converted = _convert(quantity, unit, units)
        if converted is not None and abs(converted - value) <= tolerance + 1e-9 * max(1.0, abs(value)):
            return True
    return False
