"""Powder patterns made by other software than labrl's simulator, for ``identify`` on real-instrument data.

The line positions and intensities come from pymatgen's ``XRDCalculator`` (its own Lorentz-
polarisation, scattering factors and Debye–Waller handling), the structures are built here from
published lattice parameters (not from labrl's library), and the profile is drawn here with
shapes labrl's fit does not use:

    FWHM(2θ) = sqrt(U tan²θ + V tanθ + W) + width_slope · 2θ + width_offset    (degrees)
    η(2θ)    = clip(eta0 + eta_slope · 2θ, 0, 1)                                (Lorentzian fraction)
    peak(x)  = η · L(x; FWHM) + (1 − η) · G(x; FWHM),  x = 2θ − 2θ_k,
               its low-angle side widened by (1 + asymmetry · cot 2θ_k) (axial divergence)

Each phase's sticks are normalised to a strongest line of 1 and multiplied by its share of the
intensity; the measured counts are Poisson draws of peak_counts · Σ peaks + background, with a
background b0 + b1 · (2θ − 2θ_min) (sloping) plus an optional low-angle hump.

Beams: ``"CuKa1"`` (a Kα1 monochromator), ``"CuKa"`` (Kα1 + ½ Kα2, each line computed by
``XRDCalculator`` at its own wavelength), or a float (one synchrotron line, Å).

``random_mixture(seed, beam)`` draws one pattern of the foreign benchmark set
(``benchmarks/xrd_identify.py --foreign``): 1-3 of the structures below, minor phases at
3-30 % of the intensity, a random profile, background and count level.

``python -m labrl.testing.foreign_xrd OUT.xy`` writes the ZnO + NiO 0.7 : 0.3 Kα1-only pattern
of issue 27.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# (space group, lattice system, a, c, sites): room-temperature structures (ICSD/COD values)
STRUCTURES: dict[str, tuple[str, str, float, float, list[tuple[str, tuple[float, float, float]]]]] = {
    "ZnO": (
        "P6_3mc",
        "hexagonal",
        3.2498,
        5.2066,
        [("Zn", (1 / 3, 2 / 3, 0.0)), ("O", (1 / 3, 2 / 3, 0.3819))],
    ),
    "NiO": ("Fm-3m", "cubic", 4.1771, 4.1771, [("Ni", (0.0, 0.0, 0.0)), ("O", (0.5, 0.5, 0.5))]),
    "MgO": ("Fm-3m", "cubic", 4.2117, 4.2117, [("Mg", (0.0, 0.0, 0.0)), ("O", (0.5, 0.5, 0.5))]),
    "NaCl": ("Fm-3m", "cubic", 5.6402, 5.6402, [("Na", (0.0, 0.0, 0.0)), ("Cl", (0.5, 0.5, 0.5))]),
    "Si": ("Fd-3m", "cubic", 5.4309, 5.4309, [("Si", (0.0, 0.0, 0.0))]),
    "CeO2": ("Fm-3m", "cubic", 5.4113, 5.4113, [("Ce", (0.0, 0.0, 0.0)), ("O", (0.25, 0.25, 0.25))]),
    "TiO2": (
        "P4_2/mnm",
        "tetragonal",
        4.5937,
        2.9587,
        [("Ti", (0.0, 0.0, 0.0)), ("O", (0.3048, 0.3048, 0.0))],
    ),
    "CaF2": ("Fm-3m", "cubic", 5.4626, 5.4626, [("Ca", (0.0, 0.0, 0.0)), ("F", (0.25, 0.25, 0.25))]),
    "Al2O3": (
        "R-3c",
        "hexagonal",
        4.7602,
        12.9933,
        [("Al", (0.0, 0.0, 0.35216)), ("O", (0.30624, 0.0, 0.25))],
    ),
    "Fe2O3": (
        "R-3c",
        "hexagonal",
        5.0356,
        13.7489,
        [("Fe", (0.0, 0.0, 0.35530)), ("O", (0.3059, 0.0, 0.25))],
    ),
    "CaCO3": (
        "R-3c",
        "hexagonal",
        4.9896,
        17.0610,
        [("Ca", (0.0, 0.0, 0.0)), ("C", (0.0, 0.0, 0.25)), ("O", (0.2578, 0.0, 0.25))],
    ),
    "ZnS": ("F-43m", "cubic", 5.4093, 5.4093, [("Zn", (0.0, 0.0, 0.0)), ("S", (0.25, 0.25, 0.25))]),
    "Fe": ("Im-3m", "cubic", 2.8665, 2.8665, [("Fe", (0.0, 0.0, 0.0))]),
    "Cu": ("Fm-3m", "cubic", 3.6149, 3.6149, [("Cu", (0.0, 0.0, 0.0))]),
    "Al": ("Fm-3m", "cubic", 4.0495, 4.0495, [("Al", (0.0, 0.0, 0.0))]),
}

# the same phase in labrl's v1 library (reduced formula and space group agree:
# tests/xrd/test_xrd_identify_foreign.py); only the benchmark's scoring uses it
LIBRARY_ID = {
    "ZnO": "ZnO_186_hP4",
    "NiO": "NiO_225_cF8",
    "MgO": "MgO_225_cF8",
    "NaCl": "NaCl_225_cF8",
    "Si": "Si_227_cF8",
    "CeO2": "CeO2_225_cF12",
    "TiO2": "TiO2_136_tP6",
    "CaF2": "CaF2_225_cF12",
    "Al2O3": "Al2O3_167_hR10",
    "Fe2O3": "Fe2O3_167_hR10",
    "CaCO3": "CaCO3_167_hR10",
    "ZnS": "ZnS_216_cF8",
    "Fe": "Fe_229_cI2",
    "Cu": "Cu_225_cF4",
    "Al": "Al_225_cF4",
}

# wavelengths (Å) as pymatgen tabulates them (``pymatgen.analysis.diffraction.xrd.WAVELENGTHS``)
DOUBLETS = {"CuKa": ("CuKa1", "CuKa2"), "MoKa": ("MoKa1", "MoKa2"), "CoKa": ("CoKa1", "CoKa2")}


def structure(name: str):
    from pymatgen.core import Lattice, Structure

    group, system, a, c, sites = STRUCTURES[name]
    lattice = {
        "cubic": Lattice.cubic(a),
        "hexagonal": Lattice.hexagonal(a, c),
        "tetragonal": Lattice.tetragonal(a, c),
    }
    species, coords = zip(*sites, strict=True)
    return Structure.from_spacegroup(group, lattice[system], list(species), [list(x) for x in coords])


@dataclass(frozen=True)
class Shape:
    """The profile of ``foreign_pattern`` (module docstring); the defaults are issue 27's case."""

    width_offset: float = 0.08
    width_slope: float = 0.0008
    caglioti_uvw: tuple[float, float, float] = (0.0, 0.0, 0.0)
    eta0: float = 0.5
    eta_slope: float = 0.0
    asymmetry: float = 0.0


def sticks(
    name: str, beam: str | float, two_theta_range: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    """(2θ, intensity) of ``XRDCalculator`` for ``beam`` (both lines of a doublet, Kα2 at half), strongest 1."""
    from pymatgen.analysis.diffraction.xrd import XRDCalculator

    lines: list[tuple[str | float, float]]
    if isinstance(beam, str) and beam in DOUBLETS:
        ka1, ka2 = DOUBLETS[beam]
        lines = [(ka1, 1.0), (ka2, 0.5)]
    else:
        lines = [(beam, 1.0)]
    pos, inten = [], []
    for wavelength, weight in lines:
        pattern = XRDCalculator(wavelength=wavelength).get_pattern(
            structure(name), scaled=False, two_theta_range=two_theta_range
        )
        pos.append(np.asarray(pattern.x))
        inten.append(weight * np.asarray(pattern.y))
    x, y = np.concatenate(pos), np.concatenate(inten)
    return x, y / y.max()


def foreign_pattern(
    shares: dict[str, float],
    beam: str | float = "CuKa1",
    *,
    two_theta_range: tuple[float, float] = (10.0, 80.0),
    step: float = 0.02,
    shape: Shape = Shape(),
    peak_counts: float = 5000.0,
    background: tuple[float, float] = (300.0, -2.0),
    hump: float = 0.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(2θ, Poisson counts) of the mixture ``shares`` (name -> share of the intensity); module docstring."""
    grid = np.arange(two_theta_range[0], two_theta_range[1] + step / 2, step)
    total = np.zeros_like(grid)
    u, v, w = shape.caglioti_uvw
    for name, share in shares.items():
        pos, inten = sticks(name, beam, two_theta_range)
        tan = np.tan(np.radians(pos / 2))
        fwhm = (
            np.sqrt(np.maximum(u * tan**2 + v * tan + w, 0.0)) + shape.width_offset + shape.width_slope * pos
        )
        eta = np.clip(shape.eta0 + shape.eta_slope * pos, 0.0, 1.0)
        dx = grid[:, None] - pos[None, :]
        # axial divergence: the low-angle side of a low-angle line is wider
        side = np.where(dx < 0, 1.0 + shape.asymmetry / np.tan(np.radians(pos)), 1.0)
        hw = fwhm * side / 2
        lorentz = 1.0 / (np.pi * hw * (1 + (dx / hw) ** 2))
        gauss = np.sqrt(np.log(2) / np.pi) / hw * np.exp(-np.log(2) * (dx / hw) ** 2)
        peaks = (eta * lorentz + (1 - eta) * gauss) * (fwhm / 2)  # height ~1 for a unit stick
        total += share * peaks @ inten
    b0, b1 = background
    mean = peak_counts * total + np.maximum(b0 + b1 * (grid - grid[0]), 1.0)
    mean += hump * np.exp(-(((grid - grid[0]) / 8.0) ** 2))
    counts = np.random.default_rng(seed).poisson(mean).astype(float)
    return grid, counts


def zno_nio(beam: str | float = "CuKa1", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Issue 27's case: ZnO 0.7 + NiO 0.3 by intensity, FWHM 0.08 + 0.0008·2θ, sloping background."""
    return foreign_pattern({"ZnO": 0.7, "NiO": 0.3}, beam, seed=seed)


#: synchrotron wavelengths of the benchmark (Å) and the scan each is measured over
SYNCHROTRON = {0.8265: (4.0, 42.0), 0.7293: (4.0, 38.0), 0.4959: (2.5, 25.0)}
#: the three beam groups of the benchmark
BEAM_GROUPS = ("CuKa1", "CuKa", "synchrotron")


@dataclass(frozen=True)
class ForeignMixture:
    """One benchmark pattern and what the user is told (the wavelength, the elements)."""

    seed: int
    beam_group: str
    shares: dict[str, float]  # structure name -> share of the intensity
    wavelength: float  # what the user passes: the Kα1, or the synchrotron line
    two_theta: np.ndarray
    counts: np.ndarray

    @property
    def elements(self) -> list[str]:
        from pymatgen.core import Composition

        return sorted({str(e) for name in self.shares for e in Composition(name).elements})


def random_mixture(seed: int, beam_group: str) -> ForeignMixture:
    """A random pattern of ``beam_group`` (``BEAM_GROUPS``), reproducible from ``seed``.

    1, 2 or 3 phases (equally likely) drawn without replacement from ``STRUCTURES``; each minor
    phase takes U(3 %, 30 %) of the intensity and the first phase the rest. Profile:
    Caglioti U 0-0.02, V -0.01-0, W 0.001-0.006 (deg²), FWHM offset 0.02-0.08°, slope
    0-0.001 per degree, η0 0.2-0.8 with slope ±0.004 per degree, asymmetry 0-0.05; 3k-20k
    counts at the strongest line; background 50-500 counts with slope -3..+1 per degree and
    a low-angle hump of 0-400 counts on half the patterns. Scan: 10-80° step 0.02° for Cu,
    the ``SYNCHROTRON`` range at step 0.01° for a synchrotron line.
    """
    if beam_group not in BEAM_GROUPS:
        raise ValueError(f"beam_group {beam_group!r}: one of {BEAM_GROUPS}")
    rng = np.random.default_rng(seed)
    names = list(rng.choice(sorted(STRUCTURES), size=int(rng.integers(1, 4)), replace=False))
    minors = {str(n): float(rng.uniform(0.03, 0.30)) for n in names[1:]}
    shares = {str(names[0]): 1.0 - sum(minors.values()), **minors}
    shape = Shape(
        width_offset=float(rng.uniform(0.02, 0.08)),
        width_slope=float(rng.uniform(0.0, 0.001)),
        caglioti_uvw=(
            float(rng.uniform(0, 0.02)),
            float(rng.uniform(-0.01, 0)),
            float(rng.uniform(0.001, 0.006)),
        ),
        eta0=float(rng.uniform(0.2, 0.8)),
        eta_slope=float(rng.uniform(-0.004, 0.004)),
        asymmetry=float(rng.uniform(0, 0.05)),
    )
    beam: str | float
    if beam_group == "synchrotron":
        beam = float(rng.choice(sorted(SYNCHROTRON)))
        scan, step, told = SYNCHROTRON[beam], 0.01, beam
    else:
        scan, step, beam, told = (10.0, 80.0), 0.02, beam_group, 1.5406
    x, y = foreign_pattern(
        shares,
        beam,
        two_theta_range=scan,
        step=step,
        shape=shape,
        peak_counts=float(rng.uniform(3000, 20000)),
        background=(float(rng.uniform(50, 500)), float(rng.uniform(-3, 1))),
        hump=float(rng.uniform(0, 400)) if rng.random() < 0.5 else 0.0,
        seed=seed,
    )
    return ForeignMixture(seed, beam_group, shares, told, x, y)


def write_xy(path: Path, x: np.ndarray, y: np.ndarray, wavelength: float | None = None) -> Path:
    """Two columns; a ``# wavelength`` comment only when given (a bare export states none)."""
    head = ["# foreign pattern (pymatgen XRDCalculator sticks)"]
    if wavelength is not None:
        head.append(f"# wavelength = {wavelength}")
    path.write_text("\n".join([*head, *(f"{a:.4f} {b:.0f}" for a, b in zip(x, y, strict=True))]) + "\n")
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "zno_nio.xy")
    print(write_xy(out, *zno_nio()))
