"""Chemical formulas: parse ``"CaFe(SiO3)2"`` into element counts and a canonical key.

Two formulas match when their reduced compositions are equal, whatever the
element order or multiplier: ``"NaCl" == "ClNa" == "Na2Cl2"``. The key is the
sorted tuple of (element, count / gcd) with counts made integral first.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

from labrl.errors import InvalidActionError

_TOKEN = re.compile(r"([A-Z][a-z]?)|(\()|(\))|(\d+(?:\.\d+)?)|(\s+)|(.)")
_ELEMENTS = frozenset(
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr Rb Sr "
    "Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb Lu Hf Ta W "
    "Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr".split()
)


def parse_formula(formula: str) -> dict[str, float]:
    """Element counts of ``formula``; raises ``InvalidActionError`` saying what is wrong."""
    if not isinstance(formula, str) or not formula.strip():
        raise InvalidActionError(f"formula must be a non-empty string like 'NaCl', got {formula!r}")
    stack: list[dict[str, float]] = [{}]
    last: dict[str, float] | None = None  # the group a following number multiplies
    for match in _TOKEN.finditer(formula.strip()):
        element, open_, close, number, space, other = match.groups()
        if element:
            if element not in _ELEMENTS:
                raise InvalidActionError(f"formula {formula!r}: {element!r} is not an element symbol")
            last = {element: 1.0}
            _merge(stack[-1], last)
        elif open_:
            stack.append({})
            last = None
        elif close:
            if len(stack) == 1:
                raise InvalidActionError(f"formula {formula!r}: unbalanced ')'")
            group = stack.pop()
            _merge(stack[-1], group)
            last = group
        elif number:
            if last is None:
                raise InvalidActionError(
                    f"formula {formula!r}: number {number} does not follow an element or ')'"
                )
            extra = float(number) - 1.0
            _merge(stack[-1], {el: n * extra for el, n in last.items()})
            last = None
        elif space:
            continue
        else:
            raise InvalidActionError(f"formula {formula!r}: unexpected character {other!r}")
    if len(stack) != 1:
        raise InvalidActionError(f"formula {formula!r}: unbalanced '('")
    counts = {el: n for el, n in stack[0].items() if n > 0}
    if not counts:
        raise InvalidActionError(f"formula {formula!r} has no elements")
    return counts


def _merge(into: dict[str, float], counts: dict[str, float]) -> None:
    for el, n in counts.items():
        into[el] = into.get(el, 0.0) + n


@lru_cache(maxsize=4096)
def composition_key(formula: str) -> tuple[tuple[str, float], ...]:
    """Canonical reduced composition: ``composition_key("Na2Cl2") == (("Cl", 1.0), ("Na", 1.0))``."""
    counts = {el: Fraction(n).limit_denominator(1000) for el, n in parse_formula(formula).items()}
    denominator = math.lcm(*(c.denominator for c in counts.values()))
    integers = {el: int(c * denominator) for el, c in counts.items()}
    divisor = math.gcd(*integers.values())
    return tuple(sorted((el, n / divisor) for el, n in integers.items()))
