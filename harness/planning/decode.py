"""The sampler as a batched decoder: one decode step's seconds grow with the sequences decoding together.

A continuously batching sampler (``LocalSampler``: up to ``max_batch_size`` live rows) advances every
live sequence by one token per decode step, and a step over ``b`` sequences takes

    t(b) = a + c b          seconds (a: the step's fixed cost, c: each sequence's share),

``b`` at most the sampler's slots (more sequences wait for a slot). So one sequence decodes at
``1 / t(b)`` tokens/s and the sampler at ``b / t(b)``, which grows with ``b`` toward ``1 / c``.
With ``c = 0`` every sequence decodes at ``1 / a`` whatever ``b``: the fixed-rate model.

Fit from a run's traces (``fit_decode``): every policy turn's generation is a *window*
``[s, s + g]`` of ``n`` tokens, its start ``s`` reconstructed from the episode's start and the
seconds before it (reset, earlier turns and env steps; the traces account for an episode's wall
time to the millisecond). Its mean batch ``b_bar`` is the time average over the window of
``min(windows open at once, slots)``, and each window says ``g / n = a + c b_bar``. ``a`` and ``c``
minimise ``sum n (g / n - a - c b_bar)^2`` (weighted least squares: a window counts by its tokens)
subject to ``a >= 0`` (on the boundary ``c = sum n b_bar (g / n) / sum n b_bar^2``: a sampler whose
throughput ``1 / c`` no batch raises, as a compute-bound CPU decode is). A sequence decoding is in the
batch itself, so its step is ``t(max(b, 1))``. The fit falls back to the fixed rate ``a = sum g / sum n``,
``c = 0`` when the run's batches vary too little to tell two parameters apart, or when ``c <= 0``;
``DecodeFit.reason`` says why. "Too little" is a slope the run does not resolve: with ``s_b`` the
token-weighted standard deviation of ``b_bar``, ``sigma^2`` the token-weighted residual variance and
``n_eff = (sum n)^2 / sum n^2`` the windows' effective number,

    se(c) = sqrt(sigma^2 / (n_eff s_b^2)),    fitted iff  c / se(c) >= MIN_SLOPE_T.

A spread in the batch is not enough by itself: a lab run of 5-8 sequences at once (``s_b`` 0.85) resolved
``c`` to 11 % (t = 9.4) and fitted what the same env's run of up to 16 gave (``a`` 1.96 against 2.12 ms,
``c`` 0.79 against 0.67 ms), where the earlier rule, ``s_b >= 1`` sequence, fell back.
A window's ``g`` includes any wait for a slot, and the learner's use of shared cores is in ``a`` and
``c`` as the calibrating run had it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from labrl.errors import ConfigError

#: the least ``c / se(c)`` that fits ``c`` (module docstring): about 3 standard errors from no slope
MIN_SLOPE_T = 3.0


@dataclass(frozen=True)
class GenerationWindow:
    """One policy turn's generation as traced: when it started (run seconds), its seconds and its tokens."""

    start_s: float
    seconds: float
    tokens: float


@dataclass(frozen=True)
class DecodeFit:
    """``t(b) = step_s + per_sequence_s x b`` (module docstring); ``fitted`` False: the fixed-rate fallback."""

    step_s: float  # a
    per_sequence_s: float  # c
    fitted: bool
    reason: str  # how it was obtained, one line
    batch_range: tuple[float, float]  # least and greatest window mean batch seen

    def step_time(self, batch: float) -> float:
        """``t(max(b, 1))``: a decoding sequence is in the batch itself."""
        return self.step_s + self.per_sequence_s * max(batch, 1.0)

    def sequence_tokens_per_s(self, batch: float) -> float:
        """``1 / t(b)``: one sequence's rate with ``b`` decoding."""
        return 1.0 / self.step_time(batch)

    def sampler_tokens_per_s(self, batch: float) -> float:
        """``b / t(b)``: the sampler's rate with ``b`` decoding."""
        return batch / self.step_time(batch)


def generation_windows(records: Iterable[dict[str, Any]]) -> list[GenerationWindow]:
    """Every policy turn of ``records`` (``episodes.jsonl`` lines) as a window: turn ``i`` starts at
    ``start_s + env_s[0] + sum_{j<i} (generation_s[j] + env_s[j + 1])`` (reset, then turn, step, ...)."""
    out = []
    for r in records:
        at = r["start_s"] + (r["env_s"][0] if r["env_s"] else 0.0)
        for i, (seconds, tokens) in enumerate(zip(r["generation_s"], r["generated_tokens"], strict=True)):
            out.append(GenerationWindow(at, seconds, tokens))
            at += seconds + (r["env_s"][i + 1] if i + 1 < len(r["env_s"]) else 0.0)
    return out


def mean_batches(windows: Sequence[GenerationWindow], slots: int) -> list[float]:
    """Each window's time-averaged ``min(windows open, slots)`` (a window with no duration: the count at its
    start). A sweep over the windows' ends and a running integral: O(n log n)."""
    events = sorted(
        [(w.start_s, 1) for w in windows] + [(w.start_s + w.seconds, -1) for w in windows],
        key=lambda e: (e[0], e[1]),
    )
    # level on [times[i], times[i + 1]); area: the integral up to times[i]
    times: list[float] = []
    levels: list[int] = []
    area = [0.0]
    open_now = 0
    for t, delta in events:
        if times and t == times[-1]:
            open_now += delta
            levels[-1] = min(open_now, slots)
            continue
        if times:
            area.append(area[-1] + levels[-1] * (t - times[-1]))
        open_now += delta
        times.append(t)
        levels.append(min(open_now, slots))

    def integral(t: float) -> float:
        i = bisect.bisect_right(times, t) - 1
        return area[i] + levels[i] * (t - times[i]) if i >= 0 else 0.0

    out = []
    for w in windows:
        if w.seconds > 0:
            out.append((integral(w.start_s + w.seconds) - integral(w.start_s)) / w.seconds)
        else:
            out.append(float(levels[bisect.bisect_right(times, w.start_s) - 1]))
    return out


def fixed_rate(
    windows: Sequence[GenerationWindow], reason: str, batch_range: tuple[float, float] = (0.0, 0.0)
) -> DecodeFit:
    """``a = sum g / sum n``, ``c = 0``: one sequence's mean rate as the run saw it, whatever the batch."""
    tokens = sum(w.tokens for w in windows)
    seconds = sum(w.seconds for w in windows)
    if tokens <= 0 or seconds <= 0:
        raise ConfigError("the traces hold no generation to calibrate the sampler from")
    return DecodeFit(seconds / tokens, 0.0, False, reason, batch_range)


def fit_decode(windows: Sequence[GenerationWindow], slots: int) -> DecodeFit:
    """``a`` and ``c`` by weighted least squares over ``windows``, or the fixed-rate fallback (module docstring)."""
    windows = [w for w in windows if w.tokens > 0]
    if slots < 1:
        raise ConfigError(f"a sampler needs at least 1 slot (got {slots})")
    if not windows:
        raise ConfigError("the traces hold no generation to calibrate the sampler from")
    x = mean_batches(windows, slots)
    batch_range = (min(x), max(x))
    weight = [w.tokens for w in windows]
    y = [w.seconds / w.tokens for w in windows]
    total = sum(weight)
    mx = sum(wi * xi for wi, xi in zip(weight, x, strict=True)) / total
    my = sum(wi * yi for wi, yi in zip(weight, y, strict=True)) / total
    sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(weight, x, strict=True)) / total
    spread = math.sqrt(sxx)
    too_little = f"fixed rate: the run's batches vary too little to fit t(b) = a + c b (batch sd {spread:.2f}"
    if sxx <= 0:
        return fixed_rate(windows, f"{too_little})", batch_range)
    sxy = sum(wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(weight, x, y, strict=True)) / total
    c = sxy / sxx
    a = my - c * mx
    if c > 0:
        residual = sum(wi * (yi - a - c * xi) ** 2 for wi, xi, yi in zip(weight, x, y, strict=True)) / total
        n_eff = total**2 / sum(wi * wi for wi in weight)
        se = math.sqrt(residual / (n_eff * sxx))
        if se > 0 and c / se < MIN_SLOPE_T:
            return fixed_rate(
                windows,
                f"{too_little}, slope {c * 1e3:.3f} +- {se * 1e3:.3f} ms: t {c / se:.1f} < {MIN_SLOPE_T:g})",
                batch_range,
            )
    if a < 0:
        # the least squares on the boundary a = 0: a sampler whose throughput 1 / c no batch raises
        a, c = (
            0.0,
            sum(wi * xi * yi for wi, xi, yi in zip(weight, x, y, strict=True))
            / sum(wi * xi * xi for wi, xi in zip(weight, x, strict=True)),
        )
    if c <= 0:
        return fixed_rate(
            windows, "fixed rate: one sequence decodes no slower in a larger batch in this run", batch_range
        )
    reason = (
        f"batched: t(b) = {a * 1e3:.2f} + {c * 1e3:.3f} b ms per decode step, fitted on {len(windows)} generations "
        f"with mean batch {batch_range[0]:.1f}-{batch_range[1]:.1f}"
    )
    return DecodeFit(a, c, True, reason, batch_range)
