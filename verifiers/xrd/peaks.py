"""Peak picking on a measured profile: what the model is shown.

Savitzky–Golay smoothing (window 7, order 2), then ``scipy.signal.find_peaks``
with a prominence floor of ``k_sigma`` counting-noise standard deviations
(√counts) or ``min_rel`` of the strongest prominence, whichever is larger.
Positions are refined by a parabola through the three highest points; widths
are full widths at half prominence (``peak_widths``). Relative intensity is
the prominence, strongest = 100.
"""

from __future__ import annotations

import numpy as np
from scipy.signal import find_peaks, peak_widths, savgol_filter


def pick_peaks(
    two_theta: np.ndarray,
    counts: np.ndarray,
    *,
    max_peaks: int = 10,
    k_sigma: float = 6.0,
    min_rel: float = 0.01,
) -> list[tuple[float, float, float]]:
    """Up to ``max_peaks`` strongest peaks as (2θ, relative intensity, FWHM), sorted by 2θ."""
    step = float(two_theta[1] - two_theta[0])
    smooth = savgol_filter(counts, 7, 2)
    sigma = float(np.median(np.sqrt(np.maximum(counts, 1.0))))
    idx, props = find_peaks(smooth, prominence=k_sigma * sigma)
    if len(idx) == 0:
        return []
    prom = props["prominences"]
    keep = prom >= min_rel * prom.max()
    idx, prom = idx[keep], prom[keep]
    widths = peak_widths(smooth, idx, rel_height=0.5)[0] * step
    inner = (idx > 0) & (idx < len(smooth) - 1)
    offset = np.zeros(len(idx))
    y0, y1, y2 = smooth[idx[inner] - 1], smooth[idx[inner]], smooth[idx[inner] + 1]
    denom = y0 - 2 * y1 + y2
    offset[inner] = np.where(denom != 0, 0.5 * (y0 - y2) / np.where(denom != 0, denom, 1.0), 0.0)
    positions = two_theta[idx] + np.clip(offset, -0.5, 0.5) * step
    rel = 100.0 * prom / prom.max()
    top = np.argsort(-rel, kind="stable")[:max_peaks]
    top = top[np.argsort(positions[top])]
    return [(float(positions[i]), float(rel[i]), float(widths[i])) for i in top]
