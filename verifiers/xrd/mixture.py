"""Samples (phase mixtures) and their simulated measurements.

Weight fractions become per-phase scale factors by the Hill–Howard relation,
the inverse of quantitative Rietveld analysis: with I_p the absolute pattern
per unit cell (2|F|²Lp), the measured phase intensity is S_p · I_p with::

    S_p ∝ w_p / (M_p · V_p)          M_p: cell mass (amu), V_p: cell volume (Å³)

so a fit that finds scale factors S_p recovers w_p = S_p M_p V_p / Σ_q S_q M_q V_q.
(Absorption contrast and microabsorption are not modelled.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from labrl.verifiers.xrd.library import Phase, resolve_phase
from labrl.verifiers.xrd.profile import Instrument, PreferredOrientation, background, phase_sticks, render


class Component(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    phase_id: str
    weight_fraction: float = Field(gt=0.0, le=1.0)
    crystallite_nm: float | None = Field(default=None, gt=1.0)
    lattice_scale: float = Field(default=1.0, ge=0.9, le=1.1)
    orientation: PreferredOrientation | None = None
    b_iso: float | None = Field(
        default=None, ge=0.0, le=10.0, description="overall isotropic Debye–Waller B (Å²) of this phase"
    )

    @model_serializer(mode="wrap")
    def _omit_unset_b(self, handler):
        # a component without B dumps exactly as before B existed (v0 task bytes stay the same)
        data = handler(self)
        if self.b_iso is None:
            data.pop("b_iso", None)
        return data


class Sample(BaseModel):
    """What is in the sample holder, and how the pattern is recorded."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    components: tuple[Component, ...]
    instrument: Instrument = Field(default_factory=Instrument)
    background: tuple[float, ...] = (200.0, -60.0, 20.0)  # Chebyshev coefficients, counts
    peak_counts: float = Field(
        default=10_000.0, gt=0.0
    )  # expected counts at the strongest point above background

    @field_validator("components")
    @classmethod
    def _nonempty(cls, components: tuple[Component, ...]) -> tuple[Component, ...]:
        if not components:
            raise ValueError("a sample needs at least one component")
        ids = [c.phase_id for c in components]
        if len(set(ids)) != len(ids):
            raise ValueError(f"components list a phase twice: {ids}")
        return components

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> Sample:
        total = sum(c.weight_fraction for c in self.components)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"component weight fractions must sum to 1, got {total:.6f}")
        return self


@dataclass(frozen=True)
class Measurement:
    two_theta: np.ndarray  # (n,) degrees
    counts: np.ndarray  # (n,) observed (Poisson) counts, float
    expected: np.ndarray  # (n,) noise-free expected counts
    background: np.ndarray  # (n,) expected background counts


def hill_howard_scale(phase: Phase, weight_fraction: float, lattice_scale: float = 1.0) -> float:
    """S ∝ w / (M V) for a phase whose lattice is scaled by ``lattice_scale``."""
    return weight_fraction / (phase.cell_mass * phase.volume * lattice_scale**3)


def weight_fractions(
    scales: dict[str, float], lattice_scales: dict[str, float] | None = None
) -> dict[str, float]:
    """Invert Hill–Howard: w_p = S_p M_p V_p / Σ S M V (scales keyed by phase id)."""
    lattice_scales = lattice_scales or {}
    mass = {
        pid: s * resolve_phase(pid).cell_mass * resolve_phase(pid).volume * lattice_scales.get(pid, 1.0) ** 3
        for pid, s in scales.items()
    }
    total = sum(mass.values())
    if total <= 0:
        return {pid: 0.0 for pid in scales}
    return {pid: m / total for pid, m in mass.items()}


def expected_pattern(sample: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid, expected counts, background) of ``sample`` without noise."""
    instrument = sample.instrument
    grid = instrument.grid()
    peaks = np.zeros_like(grid)
    for comp in sample.components:
        phase = resolve_phase(comp.phase_id)
        pos, inten = phase_sticks(
            phase,
            instrument,
            lattice_scale=comp.lattice_scale,
            orientation=comp.orientation,
            b_iso=comp.b_iso,
        )
        scale = hill_howard_scale(phase, comp.weight_fraction, comp.lattice_scale)
        peaks += scale * render(instrument, pos, inten, crystallite_nm=comp.crystallite_nm, grid=grid)
    peaks *= sample.peak_counts / peaks.max()
    bg = np.maximum(background(instrument, sample.background, grid), 1.0)
    return grid, peaks + bg, bg


def measure(sample: Sample, seed: int) -> Measurement:
    """One noisy measurement of ``sample`` (Poisson counting), deterministic per seed."""
    grid, expected, bg = expected_pattern(sample)
    counts = np.random.default_rng(seed).poisson(expected).astype(float)
    return Measurement(two_theta=grid, counts=counts, expected=expected, background=bg)
