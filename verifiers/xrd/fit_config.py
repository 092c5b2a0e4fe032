"""The settings and the result of a phase fit, shared by the v0 fit (``fit``) and the v1 fit (``fit_v1``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class FitV1Options(BaseModel):
    """Settings of the v1 fit and reward (``fit_v1``); ignored by ``version="v0"``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size_grid_nm: tuple[float, ...] = (12.0, 20.0, 35.0, 60.0, 100.0, 170.0, 300.0, 600.0, 2000.0)
    microstrain_grid: tuple[float, ...] = (0.0, 0.0005, 0.001, 0.002, 0.004)
    # zero shift and displacement (cos θ) are nearly collinear over a 10-80° scan: off by default
    max_displacement_mm: float = Field(default=0.0, ge=0.0, le=1.0)
    # a phase is superfluous when its F-statistic is below the F distribution's 1 − level quantile
    significance_level: float = Field(default=1e-3, gt=0.0, le=0.05)
    # count a phase's Δχ² only where its contribution exceeds the other phases' (its own lines)
    unique_lines: bool = True
    # inflate each phase's misfit scale by the serial correlation of the residuals where it has
    # intensity (Bérar & Lelann 1991): a profile shape the model lacks leaves correlated residuals,
    # fewer independent points than the scan has. Off for the envs' reward (their patterns come
    # from labrl's own simulator); ``identify`` turns it on for measured patterns
    serial_correlation: bool = False
    fraction_tolerance: float = Field(default=0.03, ge=0.0, le=1.0)
    fraction_scale: float = Field(default=0.2, gt=0.0, le=1.0)
    fraction_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    # one isotropic Debye–Waller B (Å²) per phase, refined in the Gauss–Newton steps from
    # ``b_iso_start`` within [0, ``max_b_iso``]; False: B = 0 (the v1 fit before B was added)
    refine_b_iso: bool = True
    b_iso_start: float = Field(default=0.5, ge=0.0, le=10.0)
    max_b_iso: float = Field(default=3.0, ge=0.0, le=10.0)


class FitConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    background_degree: int = Field(default=4, ge=0, le=12)
    max_zero_shift: float = Field(default=0.12, ge=0.0, le=1.0)
    max_lattice_strain: float = Field(default=0.004, ge=0.0, le=0.05)
    crystallite_grid_nm: tuple[float, ...] = (25.0, 50.0, 100.0, 400.0)
    min_gain: float = Field(default=0.02, ge=0.0, le=1.0)
    penalty: float = Field(default=0.25, ge=0.0, le=1.0)
    # "v0": the fit above, unchanged (``xrd/phase-id-v0`` and ``xrd/tools-v0`` score with it);
    # "v1": ``fit_v1`` (per-phase size and microstrain, displacement, significance test, fractions)
    version: Literal["v0", "v1"] = "v0"
    v1: FitV1Options = Field(default_factory=FitV1Options)


@dataclass(frozen=True)
class FitResult:
    phase_ids: tuple[str, ...]
    rwp: float
    rwp_background: float
    rexp: float
    scales: dict[str, float]
    weight_fractions: dict[str, float]
    zero_shift: float
    lattice_scales: dict[str, float]
    crystallite_nm: float
    superfluous: tuple[str, ...]
    quality: float
    reward: float
    profile: np.ndarray = field(repr=False)  # (n,) fitted model
    # v1 only (None / empty under v0)
    version: str = "v0"
    crystallite_nm_by_phase: dict[str, float] = field(default_factory=dict)
    microstrain: dict[str, float] = field(default_factory=dict)
    displacement_mm: float | None = None
    significance: dict[str, float] = field(default_factory=dict)
    fraction_mae: float | None = None
    background: np.ndarray | None = field(default=None, repr=False)  # (n,) fitted background
    b_iso: dict[str, float] = field(default_factory=dict)  # refined Debye–Waller B per phase (Å²)

    def summary(self) -> dict[str, object]:
        if self.version != "v0":
            return self._summary_v1()
        return {
            "rwp": round(self.rwp, 5),
            "rwp_background": round(self.rwp_background, 5),
            "rexp": round(self.rexp, 5),
            "weight_fractions": {k: round(v, 4) for k, v in self.weight_fractions.items()},
            "zero_shift": round(self.zero_shift, 4),
            "lattice_scales": {k: round(v, 5) for k, v in self.lattice_scales.items()},
            "crystallite_nm": self.crystallite_nm,
            "superfluous": list(self.superfluous),
            "quality": round(self.quality, 4),
            "reward": round(self.reward, 4),
        }

    def _summary_v1(self) -> dict[str, object]:
        return {
            "version": self.version,
            "rwp": round(self.rwp, 5),
            "rwp_background": round(self.rwp_background, 5),
            "rexp": round(self.rexp, 5),
            "weight_fractions": {k: round(v, 4) for k, v in self.weight_fractions.items()},
            "zero_shift": round(self.zero_shift, 4),
            "displacement_mm": None if self.displacement_mm is None else round(self.displacement_mm, 4),
            "lattice_scales": {k: round(v, 5) for k, v in self.lattice_scales.items()},
            "crystallite_nm": {k: round(v, 1) for k, v in self.crystallite_nm_by_phase.items()},
            "microstrain": {k: round(v, 5) for k, v in self.microstrain.items()},
            "b_iso": {k: round(v, 3) for k, v in self.b_iso.items()},
            "significance": {k: round(v, 2) for k, v in self.significance.items()},
            "superfluous": list(self.superfluous),
            "fraction_mae": None if self.fraction_mae is None else round(self.fraction_mae, 4),
            "quality": round(self.quality, 4),
            "reward": round(self.reward, 4),
        }
