"""The simulated diffractometer: measure a sample, pick peaks (runs in the process pool)."""

from __future__ import annotations

from typing import Any

import numpy as np

from labrl.verifiers.xrd.mixture import Sample, measure
from labrl.verifiers.xrd.peaks import pick_peaks


def observe(sample: dict[str, Any], noise_seed: int, n_peaks: int, profile_points: int) -> dict[str, Any]:
    """Measure ``sample`` (a ``Sample`` as JSON data); returns counts, peaks and a downsampled profile."""
    parsed = Sample.model_validate(sample)
    m = measure(parsed, noise_seed)
    out: dict[str, Any] = {
        "two_theta": m.two_theta,
        "counts": m.counts,
        "peaks": pick_peaks(m.two_theta, m.counts, max_peaks=n_peaks),
    }
    if profile_points:
        # mean counts in equal 2θ bins, rounded: a coarse look at the whole scan
        bins = np.array_split(m.counts, profile_points)
        out["profile"] = (
            float(m.two_theta[0]),
            float(m.two_theta[-1]),
            [round(float(b.mean())) for b in bins],
        )
    return out
