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
   Optional physics (all off by default: then the result equals pymatgen's):

   - anomalous dispersion, f_e → f_e(s) + f′_e + i f″_e at the tabulated
     anode line nearest λ (``anomalous``, see ``labrl.verifiers.xrd.anomalous``);
   - an isotropic Debye–Waller factor per site, exp(−B_n s²), with B_n in Å²
     (``site_b``, shape (N,)); it multiplies each site's phase factor.

5. Intensity. Both Friedel mates are summed explicitly: with real
   occupancies the site sums of −g are the complex conjugates of those of g,
   so with S_e(g) = Σ_n o_{n,e} exp(2πi hkl·r_n)::

       I(g) = (|Σ_e f_e S_e|² + |Σ_e f_e S_e*|²) · Lp(θ)

   which is 2|F|² Lp when the f_e are real (no anomalous term). The
   Lorentz–polarisation factor without a monochromator (pymatgen's) is
   Lp = (1 + cos² 2θ) / (sin² θ cos θ); with a monochromator crystal at
   Bragg angle 2θ_m (``monochromator_two_theta``, degrees) the polarisation
   term becomes::

       P = 2 (1 + cos² 2θ_m cos² 2θ) / (1 + cos² 2θ_m)

   (normalised so that 2θ_m = 0 gives the unpolarised 1 + cos² 2θ again).
6. Merging: reflections whose 2θ round to the same multiple of 1e-5° are summed
   and placed at the lowest 2θ of the group (pymatgen's TWO_THETA_TOL); peaks
   at or below 1e-3 % of the strongest are dropped (SCALED_INTENSITY_TOL).

No hkl families are built (pymatgen spends most of its time there); that is
the main reason this is faster. Memory is bounded whatever the cell: the hkl
box is scanned one h-slab at a time and structure factors are summed over
chunks of at most ``CHUNK_ELEMENTS`` (reflection, site) pairs, so a 576-atom
cell with Mo Kα needs tens of MB, not tens of GB. ``reflections`` returns the unmerged list
with Miller indices and reciprocal vectors, which preferred-orientation
corrections need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict, Unpack

import numpy as np

from labrl.errors import ConfigError
from labrl.verifiers.xrd.anomalous import dispersion
from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.scattering import CU_KA, scattering_table

TWO_THETA_TOL = 1e-5  # degrees, pymatgen AbstractDiffractionPatternCalculator.TWO_THETA_TOL
SCALED_INTENSITY_TOL = 1e-3  # percent of the strongest peak, pymatgen SCALED_INTENSITY_TOL
_SF_CONSTANT = 41.78214  # the constant in pymatgen's f(s)
#: (reflection, site) pairs per structure-factor chunk: 2**15 complex = 512 kB per temporary,
#: small enough to stay in cache (larger chunks measured 2-3x slower)
CHUNK_ELEMENTS = 1 << 15


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


def _hkl_in_sphere(recip: np.ndarray, lattice: np.ndarray, g_min: float, g_max: float) -> np.ndarray:
    """Integer hkl with g_min ≤ |g| ≤ g_max in the Friedel half-space: (M, 3).

    The box |h| ≤ g_max·|a| (likewise k, l) is scanned one h-slab at a time,
    so the temporary is one slab, not the whole box. The order is that of a
    full h-major box (h, then k, then l ascending).
    """
    bounds = np.floor(g_max * np.linalg.norm(lattice, axis=1) + 1e-9).astype(int)
    k = np.arange(-bounds[1], bounds[1] + 1)
    ell = np.arange(-bounds[2], bounds[2] + 1)
    kk, ll = np.meshgrid(k, ell, indexing="ij")
    kl = np.stack([kk.ravel(), ll.ravel()], axis=1)  # (K·L, 2)
    kl_cart = kl @ recip[1:]  # (K·L, 3)
    upper = (kl[:, 0] > 0) | ((kl[:, 0] == 0) & (kl[:, 1] > 0))  # the half-plane kept at h = 0
    parts = []
    for h in range(bounds[0] + 1):
        g_cart = kl_cart + h * recip[0]
        g2 = np.einsum("ij,ij->i", g_cart, g_cart)
        keep = (g2 <= g_max * g_max * (1 + 1e-12)) & (g2 >= g_min * g_min * (1 - 1e-12))
        if h == 0:
            keep &= upper
        rows = kl[keep]
        parts.append(np.column_stack([np.full(len(rows), h), rows]))
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=int)


def lorentz_polarization(theta: np.ndarray, monochromator_two_theta: float | None = None) -> np.ndarray:
    """Lp(θ) (see the module docstring); θ in radians, 2θ_m in degrees or None."""
    cos2t2 = np.cos(2.0 * theta) ** 2
    if monochromator_two_theta is None:
        polarization = 1.0 + cos2t2
    else:
        cm2 = math.cos(math.radians(monochromator_two_theta)) ** 2
        polarization = 2.0 * (1.0 + cm2 * cos2t2) / (1.0 + cm2)
    return polarization / (np.sin(theta) ** 2 * np.cos(theta))


def _scattering_factors(elements: tuple[str, ...], s2: np.ndarray) -> np.ndarray:
    """f_e(s) (M, E) from the 4-term fit (module docstring, step 3)."""
    z, coeff = scattering_table().coefficients(list(elements))  # (E,), (E, 4, 2)
    return z[None, :] - _SF_CONSTANT * s2[:, None] * np.einsum(
        "ei,mei->me", coeff[:, :, 0], np.exp(-coeff[None, :, :, 1] * s2[:, None, None])
    )


def _phase_factors(
    tables: list[np.ndarray], ix: np.ndarray, site_b: np.ndarray | None, s2: np.ndarray
) -> np.ndarray:
    """exp(2πi hkl·r_n) = X_h Y_k Z_l per (reflection, site), times exp(−B_n s²) when given: (C, N)."""
    phase_factor = tables[0][ix[:, 0]] * tables[1][ix[:, 1]] * tables[2][ix[:, 2]]
    if site_b is not None:
        phase_factor *= np.exp(-np.asarray(site_b)[None, :] * s2[:, None])
    return phase_factor


def _site_sums(
    phase_factor: np.ndarray, members: list[np.ndarray], weights: list[np.ndarray], ordered: bool
) -> np.ndarray:
    """S_e = Σ_n o_{n,e} · phase factor, per element: (C, E)."""
    n_sites = phase_factor.shape[1]
    out = np.empty((len(phase_factor), len(members)), dtype=complex)
    for e, (m, w) in enumerate(zip(members, weights, strict=True)):
        block = phase_factor[:, m] if len(m) < n_sites else phase_factor
        out[:, e] = block.sum(axis=1) if ordered else block @ w
    return out


def reflections(
    phase: Phase,
    *,
    wavelength: float = CU_KA,
    two_theta_range: tuple[float, float] = (0.0, 90.0),
    debye_waller: dict[str, float] | None = None,
    lattice_scale: float = 1.0,
    site_b: np.ndarray | None = None,
    anomalous: bool = False,
    monochromator_two_theta: float | None = None,
) -> Reflections:
    """All reflections of ``phase`` in ``two_theta_range`` (see the module docstring).

    ``debye_waller`` gives B (Å²) per element, ``site_b`` per site (N,); both
    may be given and multiply. ``anomalous`` adds f′ + i f″ at the anode line
    nearest ``wavelength``.
    """
    lattice = phase.lattice * lattice_scale  # (3, 3)
    recip = np.linalg.inv(lattice).T  # (3, 3) rows b1, b2, b3
    g_min, g_max = (2.0 * math.sin(math.radians(t / 2.0)) / wavelength for t in two_theta_range)
    hkl = _hkl_in_sphere(recip, lattice, g_min, g_max)  # (M, 3)
    g_cart = hkl @ recip  # (M, 3)
    g = np.sqrt(np.einsum("ij,ij->i", g_cart, g_cart))  # (M,)
    keep = (g <= g_max) & (g >= g_min)
    hkl, g_cart, g = hkl[keep], g_cart[keep], g[keep]
    order = np.argsort(g, kind="stable")
    hkl, g_cart, g = hkl[order], g_cart[order], g[order]

    theta = np.arcsin(np.clip(wavelength * g / 2.0, -1.0, 1.0))  # (M,)
    s2 = (g / 2.0) ** 2  # (M,)
    if site_b is not None and len(site_b) != len(phase.frac_coords):
        raise ConfigError(f"site_b has {len(site_b)} values for {len(phase.frac_coords)} sites of {phase.id}")
    element_b = (
        np.array([debye_waller.get(el, 0.0) for el in phase.elements]) if debye_waller else None
    )  # (E,)
    f_anom = dispersion(phase.elements, wavelength) if anomalous else None  # (E,) complex

    frac = phase.frac_coords  # (N, 3)
    # per-axis phase tables exp(2πi n x) for n in [-nmax, nmax]: (2 nmax + 1, N) each
    nmax = int(np.abs(hkl).max()) if len(hkl) else 0
    n = np.arange(-nmax, nmax + 1)[:, None]
    tables = [np.exp(2j * math.pi * n * frac[None, :, axis]) for axis in range(3)]
    idx = hkl + nmax  # (M, 3)
    # per element, the sites holding it and their occupancies: the site sums are formed without BLAS
    # (a threaded zgemm with E ≤ 5 columns oversubscribes small machines and ran 20x slower)
    members = [np.flatnonzero(phase.occupancy[:, e] > 0) for e in range(len(phase.elements))]
    weights = [phase.occupancy[m, e] for e, m in enumerate(members)]
    ordered = all(np.all(w == 1.0) for w in weights)
    intensity_f = np.empty(len(hkl))
    chunk = max(1, CHUNK_ELEMENTS // max(len(frac), 1))
    for a in range(0, len(hkl), chunk):
        rows = slice(a, a + chunk)
        f = _scattering_factors(phase.elements, s2[rows])  # (C, E)
        if element_b is not None:
            f = f * np.exp(-element_b[None, :] * s2[rows, None])
        phase_factor = _phase_factors(tables, idx[rows], site_b, s2[rows])  # (C, N)
        site_sums = _site_sums(phase_factor, members, weights, ordered)  # (C, E)
        if f_anom is None:
            structure_factor = np.einsum("me,me->m", f, site_sums)  # (C,)
            intensity_f[rows] = 2.0 * (structure_factor.real**2 + structure_factor.imag**2)
        else:
            fc = f + f_anom[None, :]  # (C, E) complex
            plus = np.einsum("me,me->m", fc, site_sums)  # F(g)
            minus = np.einsum("me,me->m", fc, site_sums.conj())  # F(−g)
            intensity_f[rows] = plus.real**2 + plus.imag**2 + minus.real**2 + minus.imag**2

    lorentz = lorentz_polarization(theta, monochromator_two_theta)
    return Reflections(
        hkl=hkl, g_cart=g_cart, two_theta=np.degrees(2.0 * theta), intensity=intensity_f * lorentz
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


class ReflectionOptions(TypedDict, total=False):
    """The keyword options of ``reflections`` (defaults there), passed through by ``stick_pattern``."""

    wavelength: float
    two_theta_range: tuple[float, float]
    debye_waller: dict[str, float] | None
    lattice_scale: float
    site_b: np.ndarray | None
    anomalous: bool
    monochromator_two_theta: float | None


def stick_pattern(phase: Phase, **options: Unpack[ReflectionOptions]) -> StickPattern:
    """The merged stick pattern of ``reflections(phase, **options)``; with the defaults equal to
    ``XRDCalculator(wavelength).get_pattern``."""
    refl = reflections(phase, **options)
    return merge(refl.two_theta, refl.intensity)
