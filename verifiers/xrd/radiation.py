"""The incident beam of a measurement: which lines, at which wavelengths, in which intensity ratio.

A ``Beam`` is the Kα1 wavelength λ₁, the Kα2 wavelength λ₂ and the ratio I(Kα2)/I(Kα1);
a single line (a Kα1 monochromator, a synchrotron) has λ₂ = λ₁ and ratio 0.

Radiation names (``--radiation``, ``identify(radiation=...)``; case-insensitive, ``α`` or ``a``):
``<Anode>Ka`` is the tube's unresolved Kα1/Kα2 doublet with ratio 0.5, ``<Anode>Ka1`` Kα1
alone. Anodes: Cr, Fe, Co, Cu, Mo, Ag, with the lines of ``anomalous.ANODE_LINES``
(International Tables Vol. C, Table 4.2.2.1).

``beam_hypotheses`` decides, in this order:

1. the file states Kα2 and its ratio (XRDML ``usedWavelength``): that beam; a ``wavelength``
   given as well must agree with it. A ``radiation`` whose lines differ from the file's only in
   Kα2 overrides them: instrument software writes the tube's Kα2 and ratio even where a Kα1
   monochromator removes Kα2 (and the reverse), and the user knows the instrument; the
   source then says so. A ``radiation`` of another anode is an error;
2. ``radiation`` names the lines (the file's or the user's wavelength must be its Kα1);
3. the wavelength is an anode's weighted mean (2 Kα1 + Kα2)/3 (within ``ANODE_TOLERANCE``): that
   anode's doublet, ratio 0.5 (an unresolved Kα is quoted by its mean);
4. the wavelength is an anode's Kα1: both hypotheses, the doublet (ratio 0.5) and Kα1 alone;
   ``identify`` fits both and keeps the one with the lower Rwp;
5. any other wavelength: one monochromatic line (synchrotron); it never gets a doublet.

Wavelengths outside ``WAVELENGTH_RANGE`` (Å) are refused: X-ray powder diffraction uses
0.05 Å (250 keV) to 5 Å; a value in keV, pm or nm is caught here or reads as an unknown line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from labrl.errors import ConfigError
from labrl.verifiers.xrd.anomalous import ANODE_LINES

ANODE_TOLERANCE = 2e-3  # Å: how close a wavelength must be to an anode line to be that line
WAVELENGTH_RANGE = (0.05, 5.0)  # Å
DOUBLET_RATIO = 0.5  # I(Kα2)/I(Kα1) of an unresolved Kα (the 2p3/2 : 2p1/2 occupancy)

#: every ``radiation`` name: the doublet and Kα1 alone of each anode
RADIATIONS = tuple(name for anode in ANODE_LINES for name in (f"{anode}Ka", f"{anode}Ka1"))

_NAME = re.compile(r"^\s*([A-Za-z]{1,2})\s*-?\s*K\s*[aα]\s*(1?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Beam:
    ka1: float  # Å
    ka2: float  # Å; equal to ka1 for a single line
    ratio: float  # I(Kα2)/I(Kα1); 0 for a single line
    label: str  # e.g. "Cu Kα1+Kα2 (Kα2/Kα1 0.5)", "Cu Kα1", "monochromatic 0.82650 Å"

    @property
    def single_line(self) -> bool:
        return self.ratio == 0.0


@dataclass(frozen=True)
class BeamHypotheses:
    """The beams to fit (one, or the doublet and Kα1 alone) and what decided them."""

    beams: tuple[Beam, ...]
    source: str  # "file", "radiation", "wavelength" or "wavelength: doublet or Kα1 alone, chosen by Rwp"


def check_wavelength(wavelength: float, what: str = "wavelength") -> float:
    """``wavelength`` (Å) as a float, or a ``ConfigError`` when it is outside ``WAVELENGTH_RANGE``."""
    lo, hi = WAVELENGTH_RANGE
    value = float(wavelength)
    if not lo <= value <= hi:
        raise ConfigError(
            f"{what} {value:g} Å is outside {lo:g}-{hi:g} Å (X-ray powder diffraction): give it in Å "
            "(Cu Kα1 = 1.54056), or name the tube with --radiation"
        )
    return value


def parse_radiation(name: str) -> tuple[str, bool]:
    """(anode, Kα1 only?) of a radiation name such as ``"CuKa"``, ``"MoKα1"`` (module docstring)."""
    match = _NAME.match(name)
    anode = match.group(1).capitalize() if match else None
    if match is None or anode not in ANODE_LINES:
        raise ConfigError(f"unknown radiation {name!r}: use one of {', '.join(RADIATIONS)}")
    return anode, match.group(2) == "1"


def doublet(anode: str, ka1: float | None = None) -> Beam:
    """The anode's Kα1/Kα2 doublet, ratio 0.5; ``ka1`` where a file states it more precisely."""
    table_ka1, ka2 = ANODE_LINES[anode]
    return Beam(table_ka1 if ka1 is None else ka1, ka2, DOUBLET_RATIO, f"{anode} Kα1+Kα2 (Kα2/Kα1 0.5)")


def single_line(wavelength: float, anode: str | None = None) -> Beam:
    label = f"{anode} Kα1" if anode else f"monochromatic {wavelength:.5f} Å"
    return Beam(wavelength, wavelength, 0.0, label)


def _anode_of(wavelength: float) -> tuple[str | None, bool]:
    """(anode, is its Kα1) when ``wavelength`` is an anode's Kα1 or weighted mean, else (None, False).

    Kα1 and the mean lie closer than ``ANODE_TOLERANCE`` (Cu: 1.54056 and 1.54184 Å), so the
    nearer of the two decides.
    """
    lines = [
        (abs(wavelength - value), anode, is_ka1)
        for anode, (ka1, ka2) in ANODE_LINES.items()
        for value, is_ka1 in ((ka1, True), ((2 * ka1 + ka2) / 3, False))
    ]
    distance, anode, is_ka1 = min(lines)
    return (anode, is_ka1) if distance < ANODE_TOLERANCE else (None, False)


def beam_hypotheses(
    file_ka1: float | None,
    file_ka2: float | None = None,
    file_ratio: float | None = None,
    *,
    radiation: str | None = None,
    wavelength: float | None = None,
    path: str = "pattern",
) -> BeamHypotheses:
    """The beams a measurement may have been made with (module docstring, rules 1-5).

    ``file_*``: what the pattern file states (None where it is silent); ``radiation`` and
    ``wavelength``: what the user says.
    """
    named = parse_radiation(radiation) if radiation is not None else None
    user = check_wavelength(wavelength) if wavelength is not None else None
    if named is not None and user is not None and abs(user - ANODE_LINES[named[0]][0]) >= ANODE_TOLERANCE:
        raise ConfigError(
            f"--wavelength {user:g} Å is not the Kα1 of --radiation {radiation} "
            f"({ANODE_LINES[named[0]][0]:g} Å): give one of them"
        )
    lam: float | None = user if user is not None else (ANODE_LINES[named[0]][0] if named else None)
    if file_ka1 is not None:
        stated = check_wavelength(file_ka1, f"{path}: the file's wavelength")
        if user is not None and abs(user - stated) >= ANODE_TOLERANCE:
            raise ConfigError(f"{path}: the file states λ = {stated:g} Å, not the {user:g} Å given")
        lam = stated
    if lam is None:
        raise ConfigError(f"{path}: the file states no wavelength; give --wavelength (Å) or --radiation")
    anode, is_ka1 = _anode_of(lam)
    if named is not None and (anode != named[0] or not is_ka1):
        raise ConfigError(f"{path}: λ = {lam:g} Å is not the Kα1 of --radiation {radiation}")
    stated_ka1 = lam if file_ka1 is not None else None  # a file's λ₁ is kept to its precision
    if file_ratio is not None and (file_ka2 is not None or file_ratio == 0.0):
        ratio = float(file_ratio)
        if named is not None and named[1] != (ratio == 0.0):
            ka1 = lam if is_ka1 else ANODE_LINES[named[0]][0]
            beam = single_line(ka1, named[0]) if named[1] else doublet(named[0], ka1)
            return BeamHypotheses((beam,), f"radiation (overrides the file's Kα2/Kα1 {ratio:g})")
        if ratio == 0.0:
            return BeamHypotheses((single_line(lam, anode if is_ka1 else None),), "file")
        label = f"{anode or 'tube'} Kα1+Kα2 (Kα2/Kα1 {ratio:g})"
        return BeamHypotheses((Beam(lam, float(file_ka2), ratio, label),), "file")  # type: ignore[arg-type]
    if named is not None:
        ka1 = ANODE_LINES[named[0]][0] if stated_ka1 is None else stated_ka1
        beam = single_line(ka1, named[0]) if named[1] else doublet(named[0], stated_ka1)
        return BeamHypotheses((beam,), "radiation")
    source = "file" if file_ka1 is not None else "wavelength"
    if anode is None:
        return BeamHypotheses((single_line(lam),), source)
    if not is_ka1:
        return BeamHypotheses((doublet(anode),), source)
    ka1 = ANODE_LINES[anode][0] if stated_ka1 is None else stated_ka1
    return BeamHypotheses(
        (doublet(anode, ka1), single_line(ka1, anode)), f"{source}: doublet or Kα1 alone, chosen by Rwp"
    )
