"""Instrument model: stick patterns -> measured powder profiles.

Per reflection at Bragg angle θ (all widths FWHM in degrees 2θ):

- instrument (Gaussian), Caglioti:  H_G² = U tan²θ + V tanθ + W
- crystallite size (Lorentzian), Scherrer:  H_L = (180/π) · K λ / (L cos θ)
- microstrain ε (Lorentzian, Williamson–Hall), optional:  H_ε = (180/π) · 4 ε tan θ,
  added to the size width (Lorentzian widths add): H_L = H_size + H_ε
- pseudo-Voigt with the Thompson–Cox–Hastings combination::

      H⁵ = H_G⁵ + 2.69269 H_G⁴H_L + 2.42843 H_G³H_L² + 4.47163 H_G²H_L³ + 0.07842 H_G H_L⁴ + H_L⁵
      q = H_L / H,   η = 1.36603 q − 0.47719 q² + 0.11116 q³
      pV(x) = η · 2/(πH) / (1 + 4x²/H²) + (1 − η) · (2/H) √(ln2/π) · exp(−4 ln2 x²/H²)

  (area-normalised, so a peak's area equals its intensity);
- Cu Kα1/Kα2 doublet: each reflection (same d, so same g) also appears at
  sin θ₂ = λ₂ g / 2 with ``ka2_ratio`` of the Kα1 intensity;
- zero shift and sample displacement s (mm) on a goniometer of radius R (mm)::

      2θ_obs = 2θ + zero − (180/π) · 2 s cos θ / R

- March–Dollase preferred orientation along reciprocal direction h₀k₀l₀ with
  parameter r (r < 1 plates, r > 1 needles; 1 = random), per reflection at
  angle α to that direction::

      P(α) = (r² cos²α + sin²α / r)^(−3/2)

- optional physics of the stick intensities (``Instrument`` fields, off by
  default so v0 measurements are unchanged; formulas in ``simulate``):
  anomalous dispersion f′ + i f″ at the Kα1 line (``anomalous_dispersion``;
  the Kα2 copy reuses the Kα1 intensities, a < 1 % error away from edges),
  a monochromator polarisation factor (``monochromator_two_theta``), and per
  phase an isotropic Debye–Waller factor exp(−B sin²θ/λ²) (``b_iso`` of
  ``phase_sticks``);
- background: a Chebyshev series in x ∈ [−1, 1] over the scanned range;
- counting noise: Poisson on the expected counts.

Peaks are evaluated on a window of ±``window_fwhm`` widths around each
centre (vectorised blocks scattered by ``bincount``), which keeps rendering
O(peaks · window) instead of O(peaks · grid points).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.polynomial import chebyshev
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from labrl.verifiers.xrd.anomalous import line_for
from labrl.verifiers.xrd.library import Phase
from labrl.verifiers.xrd.scattering import CU_KA1, CU_KA2
from labrl.verifiers.xrd.simulate import merge, reflections

_LN2 = math.log(2.0)


class Instrument(BaseModel):
    """A Bragg–Brentano diffractometer with a Cu tube."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    two_theta_min: float = Field(default=10.0, ge=0.0, lt=180.0)
    two_theta_max: float = Field(default=80.0, gt=0.0, le=180.0)
    step: float = Field(default=0.02, gt=0.0, le=1.0)
    wavelength_ka1: float = Field(default=CU_KA1, gt=0.0)
    wavelength_ka2: float = Field(default=CU_KA2, gt=0.0)
    ka2_ratio: float = Field(default=0.5, ge=0.0, le=1.0)
    caglioti_u: float = 0.004
    caglioti_v: float = -0.002
    caglioti_w: float = 0.002
    scherrer_k: float = Field(default=0.9, gt=0.0)
    zero_shift: float = Field(default=0.0, ge=-1.0, le=1.0)
    displacement_mm: float = Field(default=0.0, ge=-1.0, le=1.0)
    goniometer_radius_mm: float = Field(default=240.0, gt=0.0)
    window_fwhm: float = Field(default=12.0, ge=3.0)
    anomalous_dispersion: bool = Field(
        default=False, description="add f' + i f'' (Chantler) at the Kα1 line to the scattering factors"
    )
    monochromator_two_theta: float | None = Field(
        default=None,
        ge=0.0,
        lt=180.0,
        description="Bragg angle 2θ_m (degrees) of a monochromator crystal (graphite 002 with Cu Kα: 26.6); "
        "None = unpolarised beam, no monochromator",
    )

    @model_serializer(mode="wrap")
    def _omit_default_physics(self, handler):
        # the physics fields are left out while off, so v0 instruments dump (and hash) as before
        data = handler(self)
        if not self.anomalous_dispersion:
            data.pop("anomalous_dispersion", None)
        if self.monochromator_two_theta is None:
            data.pop("monochromator_two_theta", None)
        return data

    @model_validator(mode="after")
    def _check(self) -> Instrument:
        if self.two_theta_max <= self.two_theta_min:
            raise ValueError(
                f"two_theta_max ({self.two_theta_max}) must exceed two_theta_min ({self.two_theta_min})"
            )
        if self.anomalous_dispersion:
            line_for(self.wavelength_ka1)  # f′, f″ are tabulated only at the anode lines
        tan = np.tan(np.radians(self.grid() / 2.0))
        h2 = self.caglioti_u * tan**2 + self.caglioti_v * tan + self.caglioti_w
        if h2.min() <= 0:
            raise ValueError(
                "caglioti_u/v/w give a non-positive squared width inside the scan range: raise caglioti_w"
            )
        return self

    def grid(self) -> np.ndarray:
        """Scan points (n,) in degrees 2θ."""
        n = round((self.two_theta_max - self.two_theta_min) / self.step) + 1
        return self.two_theta_min + self.step * np.arange(n)

    def fwhm_eta(
        self,
        two_theta: np.ndarray,
        crystallite_nm: float | np.ndarray | None,
        microstrain: float | np.ndarray = 0.0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(H, η) of the pseudo-Voigt at ``two_theta`` (see module docstring).

        ``crystallite_nm`` and ``microstrain`` are scalars or one value per position.
        """
        theta = np.radians(two_theta / 2.0)
        tan = np.tan(theta)
        hg = np.sqrt(np.maximum(self.caglioti_u * tan**2 + self.caglioti_v * tan + self.caglioti_w, 1e-8))
        strained = np.any(np.asarray(microstrain) != 0.0)
        if crystallite_nm is None and not strained:
            return hg, np.zeros_like(hg)
        hl = (
            np.degrees(self.scherrer_k * self.wavelength_ka1 / (10.0 * crystallite_nm * np.cos(theta)))
            if crystallite_nm is not None
            else np.zeros_like(hg)
        )
        if strained:
            hl = hl + np.degrees(4.0 * np.asarray(microstrain) * tan)
        # TCH in Horner form: H⁵ = H_G⁵ · (1 + 2.69269 r + 2.42843 r² + 4.47163 r³ + 0.07842 r⁴ + r⁵), r = H_L/H_G
        r = hl / hg
        poly = ((((r + 0.07842) * r + 4.47163) * r + 2.42843) * r + 2.69269) * r + 1.0
        h = hg * poly**0.2
        q = hl / h
        return h, ((0.11116 * q - 0.47719) * q + 1.36603) * q

    def shift(self, two_theta: np.ndarray) -> np.ndarray:
        """Observed positions after zero shift and sample displacement."""
        cos = np.cos(np.radians(two_theta / 2.0))
        return (
            two_theta
            + self.zero_shift
            - np.degrees(2.0 * self.displacement_mm * cos / self.goniometer_radius_mm)
        )


class PreferredOrientation(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    hkl: tuple[int, int, int] = (0, 0, 1)
    r: float = Field(default=1.0, gt=0.05, le=20.0)

    @model_validator(mode="after")
    def _nonzero(self) -> PreferredOrientation:
        if self.hkl == (0, 0, 0):
            raise ValueError("preferred orientation hkl must not be (0, 0, 0)")
        return self


def march_dollase(g_cart: np.ndarray, direction: np.ndarray, r: float) -> np.ndarray:
    """P(α) for reciprocal vectors ``g_cart`` (M, 3) and a direction (3,): (M,)."""
    cos2 = (g_cart @ direction) ** 2 / (np.einsum("ij,ij->i", g_cart, g_cart) * (direction @ direction))
    return (r**2 * cos2 + (1.0 - cos2) / r) ** -1.5


def phase_sticks(
    phase: Phase,
    instrument: Instrument,
    *,
    lattice_scale: float = 1.0,
    orientation: PreferredOrientation | None = None,
    debye_waller: dict[str, float] | None = None,
    b_iso: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Kα1 stick positions (unshifted) and absolute intensities of ``phase`` inside the scan.

    The range is widened by 1° so that peaks just outside still leak their tails in.
    ``b_iso`` (Å²) is one Debye–Waller B for every atom of the phase;
    ``debye_waller`` gives B per element (both may be given: they multiply).
    """
    if b_iso is not None:
        debye_waller = {el: b_iso + (debye_waller or {}).get(el, 0.0) for el in phase.elements}
    lo = max(instrument.two_theta_min - 1.0, 0.1)
    hi = min(instrument.two_theta_max + 1.0, 179.0)
    refl = reflections(
        phase,
        wavelength=instrument.wavelength_ka1,
        two_theta_range=(lo, hi),
        debye_waller=debye_waller,
        lattice_scale=lattice_scale,
        anomalous=instrument.anomalous_dispersion,
        monochromator_two_theta=instrument.monochromator_two_theta,
    )
    intensity = refl.intensity
    if orientation is not None and orientation.r != 1.0:
        direction = np.asarray(orientation.hkl, dtype=float) @ np.linalg.inv(phase.lattice * lattice_scale).T
        intensity = intensity * march_dollase(refl.g_cart, direction, orientation.r)
    sticks = merge(refl.two_theta, intensity)
    return sticks.two_theta, sticks.intensity


def rescale_positions(two_theta: np.ndarray, scale: float, wavelength: float) -> np.ndarray:
    """Stick positions after scaling the lattice by ``scale`` (d -> d·scale); NaN where no Bragg angle exists."""
    sin = np.sin(np.radians(two_theta / 2.0)) / scale
    out = np.full_like(two_theta, np.nan)
    ok = sin < 1.0
    out[ok] = np.degrees(2.0 * np.arcsin(sin[ok]))
    return out


def render(
    instrument: Instrument,
    two_theta: np.ndarray,
    intensity: np.ndarray,
    *,
    crystallite_nm: float | None = None,
    grid: np.ndarray | None = None,
) -> np.ndarray:
    """Profile (n,) of Kα1 sticks (P,) with the doublet, shifts and peak shapes; no background."""
    grid = instrument.grid() if grid is None else grid
    ok = np.isfinite(two_theta)
    two_theta, intensity = two_theta[ok], intensity[ok]
    positions = [two_theta]
    weights = [intensity]
    if instrument.ka2_ratio > 0:
        sin2 = np.sin(np.radians(two_theta / 2.0)) * instrument.wavelength_ka2 / instrument.wavelength_ka1
        ok2 = sin2 < 1.0
        positions.append(np.degrees(2.0 * np.arcsin(sin2[ok2])))
        weights.append(intensity[ok2] * instrument.ka2_ratio)
    centres = instrument.shift(np.concatenate(positions))  # (P2,)
    areas = np.concatenate(weights)  # (P2,)
    fwhm, eta = instrument.fwhm_eta(centres, crystallite_nm)  # (P2,), (P2,)
    return _pseudo_voigt_sum(grid, centres, areas, fwhm, eta, instrument.window_fwhm)


def render_phases(
    instrument: Instrument,
    sticks: list[tuple[np.ndarray, np.ndarray]],
    lattice_scales: list[float],
    *,
    crystallite_nm: float | list[float] | None = None,
    grid: np.ndarray | None = None,
    microstrain: list[float] | None = None,
) -> list[np.ndarray]:
    """``render`` of several phases' Kα1 sticks after ``rescale_positions``: one profile (n,) each.

    The per-reflection physics (rescaling, doublet, shifts, widths) runs once on
    all phases' sticks together; the peak sums stay per phase, so each profile
    equals ``render(instrument, rescale_positions(pos, scale, λ1), intensity, ...)``.
    ``crystallite_nm`` may give one size per phase and ``microstrain`` one ε per phase.
    """
    grid = instrument.grid() if grid is None else grid
    counts = [len(pos) for pos, _ in sticks]
    label = np.repeat(np.arange(len(sticks)), counts)  # (S,) phase of each stick
    scale = np.repeat(np.asarray(lattice_scales, dtype=float), counts)  # (S,)
    pos = np.concatenate([p for p, _ in sticks]) if sticks else np.zeros(0)
    inten = np.concatenate([i for _, i in sticks]) if sticks else np.zeros(0)
    sin = np.sin(np.radians(pos / 2.0)) / scale  # rescale_positions, vectorised over phases
    ok = sin < 1.0
    label, inten = label[ok], inten[ok]
    two_theta = np.degrees(2.0 * np.arcsin(sin[ok]))
    labels, positions, weights = [label], [two_theta], [inten]
    if instrument.ka2_ratio > 0:
        sin2 = np.sin(np.radians(two_theta / 2.0)) * instrument.wavelength_ka2 / instrument.wavelength_ka1
        ok2 = sin2 < 1.0
        labels.append(label[ok2])
        positions.append(np.degrees(2.0 * np.arcsin(sin2[ok2])))
        weights.append(inten[ok2] * instrument.ka2_ratio)
    label = np.concatenate(labels)
    order = np.argsort(label, kind="stable")  # per phase: its Kα1 peaks, then its Kα2 peaks, as ``render``
    centres = instrument.shift(np.concatenate(positions)[order])  # (P2,)
    areas = np.concatenate(weights)[order]  # (P2,)
    sorted_label = label[order]
    size: float | np.ndarray | None = crystallite_nm  # type: ignore[assignment]
    if isinstance(crystallite_nm, list | tuple):
        size = np.asarray(crystallite_nm, dtype=float)[sorted_label]  # one size per phase -> per peak
    strain: float | np.ndarray = 0.0
    if microstrain is not None:
        strain = np.asarray(microstrain, dtype=float)[sorted_label]
    fwhm, eta = instrument.fwhm_eta(centres, size, strain)  # (P2,), (P2,)
    bounds = np.searchsorted(sorted_label, np.arange(len(sticks) + 1)).tolist()
    return [
        _pseudo_voigt_sum(grid, centres[a:b], areas[a:b], fwhm[a:b], eta[a:b], instrument.window_fwhm)
        for a, b in itertools.pairwise(bounds)
    ]


_BLOCK_ELEMENTS = 16384  # peaks are evaluated in blocks of about this many (peak, point) pairs (~128 kB)


def _pseudo_voigt_sum(
    grid: np.ndarray, centres: np.ndarray, areas: np.ndarray, fwhm: np.ndarray, eta: np.ndarray, window: float
) -> np.ndarray:
    """Σ_p areas_p · pV_p on ``grid``: Lorentzian tails to ±window·H, the Gaussian part to ±3H.

    H is the largest width of the call, so every peak gets the same window of
    grid points around its nearest point. Beyond 3H the Gaussian is below
    1e-10 of its peak, so only the cheap Lorentzian term is evaluated in the
    tails. With u = 2x/H_p (x the distance to the centre)::

        areas · pV = L_p / (1 + u²) + G_p · exp(−ln2 · u²),
        L_p = areas · η (2/πH_p),   G_p = areas · (1 − η) (2/H_p) √(ln2/π)

    Peaks are evaluated in blocks small enough to stay in cache, and each
    block is scattered by one ``bincount`` into a padded copy of the grid, so
    windows crossing the scan edges need no mask.
    """
    n = len(grid)
    if len(centres) == 0:
        return np.zeros(n)
    x0 = grid[0]
    step = grid[1] - grid[0]
    h_max = float(fwhm.max())
    half_g = math.ceil(3.0 * h_max / step)
    lorentz = bool(eta.any())
    half = max(math.ceil(window * h_max / step), half_g) if lorentz else half_g
    width = 2 * half + 1
    centre_idx = np.rint((centres - x0) / step).astype(np.int64)  # (P,)
    two_inv_h = 2.0 / fwhm  # (P,)
    offsets = step * np.arange(-half, half + 1)  # (K,) distance of window points to the nearest point
    nearest = (x0 + step * centre_idx - centres) * two_inv_h  # (P,) u of the nearest point
    gauss_w = areas * (1.0 - eta) * math.sqrt(_LN2 / math.pi) * two_inv_h  # (P,)
    lor_w = areas * eta * (1.0 / math.pi) * two_inv_h  # (P,)
    inner = slice(half - half_g, half + half_g + 1)  # the Gaussian's ±3H
    lo = min(int(centre_idx.min()) - half, 0)  # the padded copy starts at grid index lo
    size = max(int(centre_idx.max()) + half + 1, n) - lo
    start = centre_idx - half - lo  # (P,) padded index of each window's first point
    span = np.arange(width)
    out = np.zeros(size)
    block = max(1, _BLOCK_ELEMENTS // width)
    for i in range(0, len(centres), block):
        rows = slice(i, i + block)
        u2 = np.multiply.outer(two_inv_h[rows], offsets)  # (B, K)
        u2 += nearest[rows, None]
        np.square(u2, out=u2)
        gauss = np.exp(-_LN2 * u2[:, inner])
        gauss *= gauss_w[rows, None]
        if lorentz:
            u2 += 1.0
            values = np.divide(lor_w[rows, None], u2, out=u2)
            values[:, inner] += gauss
        else:
            values = gauss
        idx = np.add.outer(start[rows], span)  # (B, K)
        out += np.bincount(idx.ravel(), weights=values.ravel(), minlength=size)
    return out[-lo : n - lo]


def background(
    instrument: Instrument, coefficients: list[float] | tuple[float, ...], grid: np.ndarray | None = None
):
    """Chebyshev background (n,) over the scan range."""
    grid = instrument.grid() if grid is None else grid
    x = 2.0 * (grid - instrument.two_theta_min) / (instrument.two_theta_max - instrument.two_theta_min) - 1.0
    return chebyshev.chebval(x, np.asarray(coefficients, dtype=float))


def chebyshev_basis(instrument: Instrument, degree: int, grid: np.ndarray | None = None) -> np.ndarray:
    """(n, degree + 1) Chebyshev columns T_0..T_degree over the scan range."""
    grid = instrument.grid() if grid is None else grid
    x = 2.0 * (grid - instrument.two_theta_min) / (instrument.two_theta_max - instrument.two_theta_min) - 1.0
    return chebyshev.chebvander(x, degree)
