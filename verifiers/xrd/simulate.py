"""Powder stick patterns: the physics of pymatgen's ``XRDCalculator``, vectorised.

For a structure with direct lattice rows A (Å) and reciprocal rows
B = (A⁻¹)ᵀ (crystallographic, no 2π):

1. Enumerate every hkl with |g| = |hkl·B| ≤ 2 sin(θ_max)/λ. Since h = g·a,
   |h| ≤ g_max·|a| bounds the integer box. Keep one Friedel half-space
   (h, k, l lexicographically positive): the scattering factors are real, so
   I(−g) = I(g) and each kept reflection counts twice.
2. Bragg: sin θ = λ|g|/2, s = |g|/2 = sin θ/λ.
3. Atomic scattering factor per element, the 4-term fit pymatgen uses (read
   from pymatgen's data, see ``scattering``), times an optional isotropic
   Debye–Waller factor exp(−B s²)::

       f_e(s) = Z_e − 41.78214 s² Σ_i a_i exp(−b_i s²)

4. Structure factor with occupancies o_{n,e}::

       F(g) = Σ_e f_e(s) Σ_n o_{n,e} exp(2πi hkl·r_n)

   The phase factor is separable, exp(2πi(hx+ky+lz)) = X_h Y_k Z_l, so it is
   built from three small per-axis tables by two complex products instead of
   one complex exponential per (reflection, site).
5. Intensity I = 2 |F|² Lp(θ), with the Lorentz–polarisation factor
   Lp = (1 + cos² 2θ) / (sin² θ cos θ).
6. Merging: reflections whose 2θ round to the same multiple of 1e-5° are summed
   and placed at the lowest 2θ of the group (pymatgen's TWO_THETA_TOL); peaks
   at or below 1e-3 % of the strongest are dropped (SCALED_INTENSITY_TOL).

No hkl families are built (pymatgen spends most of its time there); that is
the main reason this is faster. ``reflections`` returns the unmerged list
with Miller indices and reciprocal vectors, which preferred-orientation
corrections need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.scattering import CU_KA, scattering_table

TWO_THETA_TOL = 1e-5  # degrees, pymatgen AbstractDiffractionPatternCalculator.TWO_THETA_TOL
SCALED_INTENSITY_TOL = 1e-3  # percent of the strongest peak, pymatgen SCALED_INTENSITY_TOL
_SF_CONSTANT = 41.78214  # the constant in pymatgen's f(s)


@dataclass(frozen=True)
class Reflections:
    """Unmerged reflections of one Friedel half-space, sorted by 2θ."""

    hkl: np.ndarray  # (M, 3) int
    g_cart: np.ndarray  # (M, 3) reciprocal vectors, 1/Å
    two_theta: np.ndarray  # (M,) degrees
    intensity: np.ndarray  # (M,) 2|F|² Lp, absolute (per unit cell)


@dataclass(frozen=True)
class StickPattern:
    two_theta: np.ndarray  # (P,) degrees, ascending
    intensity: np.ndarray  # (P,) absolute: 2|F|² Lp summed over merged reflections

    @property
    def scaled(self) -> np.ndarray:
        """Intensities with the strongest peak at 100 (pymatgen's ``scaled=True``)."""
        return self.intensity / self.intensity.max() * 100.0


def _hkl_box(recip: np.ndarray, lattice: np.ndarray, g_max: float) -> np.ndarray:
    """Integer hkl with |g| ≤ g_max in the Friedel half-space: (M, 3)."""
    bounds = np.floor(g_max * np.linalg.norm(lattice, axis=1) + 1e-9).astype(int)
    h = np.arange(0, bounds[0] + 1)
    k = np.arange(-bounds[1], bounds[1] + 1)
    ell = np.arange(-bounds[2], bounds[2] + 1)
    hh, kk, ll = np.meshgrid(h, k, ell, indexing="ij")
    hkl = np.stack([hh.ravel(), kk.ravel(), ll.ravel()], axis=1)  # (Mbox, 3)
    half = (
        (hkl[:, 0] > 0)
        | ((hkl[:, 0] == 0) & (hkl[:, 1] > 0))
        | ((hkl[:, 0] == 0) & (hkl[:, 1] == 0) & (hkl[:, 2] > 0))
    )
    return hkl[half]


def reflections(
    phase: Phase,
    *,
    wavelength: float = CU_KA,
    two_theta_range: tuple[float, float] = (0.0, 90.0),
    debye_waller: dict[str, float] | None = None,
    lattice_scale: float = 1.0,
) -> Reflections:
    """All reflections of ``phase`` in ``two_theta_range`` (see the module docstring)."""
    lattice = phase.lattice * lattice_scale  # (3, 3)
    recip = np.linalg.inv(lattice).T  # (3, 3) rows b1, b2, b3
    g_min, g_max = (2.0 * math.sin(math.radians(t / 2.0)) / wavelength for t in two_theta_range)
    hkl = _hkl_box(recip, lattice, g_max)  # (M, 3)
    g_cart = hkl @ recip  # (M, 3)
    g = np.sqrt(np.einsum("ij,ij->i", g_cart, g_cart))  # (M,)
    keep = (g <= g_max) & (g >= g_min)
    hkl, g_cart, g = hkl[keep], g_cart[keep], g[keep]
    order = np.argsort(g, kind="stable")
    hkl, g_cart, g = hkl[order], g_cart[order], g[order]

    theta = np.arcsin(np.clip(wavelength * g / 2.0, -1.0, 1.0))  # (M,)
    s2 = (g / 2.0) ** 2  # (M,)

    table = scattering_table()
    z, coeff = table.coefficients(list(phase.elements))  # (E,), (E, 4, 2)
    # f_e(s) for every reflection and element: (M, E)
    f = z[None, :] - _SF_CONSTANT * s2[:, None] * np.einsum(
        "ei,mei->me", coeff[:, :, 0], np.exp(-coeff[None, :, :, 1] * s2[:, None, None])
    )
    if debye_waller:
        b = np.array([debye_waller.get(el, 0.0) for el in phase.elements])  # (E,)
        f = f * np.exp(-b[None, :] * s2[:, None])

    frac = phase.frac_coords  # (N, 3)
    # per-axis phase tables exp(2πi n x) for n in [-nmax, nmax]: (2 nmax + 1, N) each
    nmax = int(np.abs(hkl).max()) if len(hkl) else 0
    n = np.arange(-nmax, nmax + 1)[:, None]
    tables = [np.exp(2j * math.pi * n * frac[None, :, axis]) for axis in range(3)]
    idx = hkl + nmax  # (M, 3)
    phase_factor = tables[0][idx[:, 0]] * tables[1][idx[:, 1]] * tables[2][idx[:, 2]]  # (M, N)
    site_sums = phase_factor @ phase.occupancy  # (M, E)
    structure_factor = np.einsum("me,me->m", f, site_sums)  # (M,)

    intensity_f = structure_factor.real**2 + structure_factor.imag**2
    lorentz = (1.0 + np.cos(2.0 * theta) ** 2) / (np.sin(theta) ** 2 * np.cos(theta))
    return Reflections(
        hkl=hkl, g_cart=g_cart, two_theta=np.degrees(2.0 * theta), intensity=2.0 * intensity_f * lorentz
    )


def merge(two_theta: np.ndarray, intensity: np.ndarray) -> StickPattern:
    """pymatgen's merging: bins of TWO_THETA_TOL, threshold SCALED_INTENSITY_TOL (input sorted by 2θ)."""
    if len(two_theta) == 0:
        return StickPattern(two_theta=np.zeros(0), intensity=np.zeros(0))
    keys = np.round(two_theta / TWO_THETA_TOL).astype(np.int64)  # (M,)
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])  # first reflection of each bin
    summed = np.add.reduceat(intensity, starts)  # (P,)
    positions = two_theta[starts]
    keep = summed / summed.max() * 100.0 > SCALED_INTENSITY_TOL
    return StickPattern(two_theta=positions[keep], intensity=summed[keep])


def stick_pattern(
    phase: Phase,
    *,
    wavelength: float = CU_KA,
    two_theta_range: tuple[float, float] = (0.0, 90.0),
    debye_waller: dict[str, float] | None = None,
    lattice_scale: float = 1.0,
) -> StickPattern:
    """The merged stick pattern, equal to ``XRDCalculator(wavelength).get_pattern(structure)``."""
    refl = reflections(
        phase,
        wavelength=wavelength,
        two_theta_range=two_theta_range,
        debye_waller=debye_waller,
        lattice_scale=lattice_scale,
    )
    return merge(refl.two_theta, refl.intensity)
