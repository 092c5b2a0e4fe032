"""``labrl plan``: simulate a handful of layouts of a run config and rank them.

The layouts are the run config with other values of the keys ``labrl train`` accepts as
overrides: ``pipeline.max_staleness`` (``pipeline`` mode only: ``sync`` and
``one_step_off`` fix it) and ``pipeline.max_concurrent_episodes``. Each is simulated
(``simulate``) for ``steps`` learner steps at its closed-form rate (``model``); the table
lists them ranked (``rank_key``, the budget search's rule too: within the config's staleness
bound first, then by simulated steps/s with rates within about 2 % a tie, then the cheaper,
then the fresher) with the closed form beside it, the idle fractions of the learner, the
sampler and the env slots, the staleness p50 / p99, the component that binds first, and flags
a layout whose staleness p99 exceeds the config's bound (``effective_max_staleness``).

The machine side comes from a calibrating run (``calibrate``: the learner's seconds per step;
``calibrate_sampler``: for the local sampler its slots ``sampler.local.max_batch_size`` (x
``ray.samplers`` under Ray) and the decode step ``t(b) = a + c b`` fitted on the run's generations
(``decode``), ``R = slots / t(slots)``; where the fit falls back, or for SGLang, the fixed rate: the
sampler's measured tokens/s ``R``, per-sequence rate ``r``, slots ``R / r`` capped as above), or without one
from ``priors`` (``base``, the config's own layout). Env calls run as the harness runs them:
one per open episode, so env slots are the layout's ``max_concurrent_episodes``, at most
``env_slot_cap`` (the env's pool) when given. ``budget`` searches Ray layouts instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from labrl.harness.config import RunConfig
from labrl.harness.pipeline.config import MAX_CONCURRENT_EPISODES
from labrl.harness.planning.calibrate import EpisodeCalibration, MachineCalibration
from labrl.harness.planning.decode import DecodeFit, fit_decode
from labrl.harness.planning.model import Layout, SteadyState, steady_state
from labrl.harness.planning.simulate import EpisodeModel, SimResult, simulate

STALENESS_CHOICES = (1, 2, 4, 8)
CONCURRENCY_FACTORS = (1, 2, 4)  # x the episodes of one batch, G x B


@dataclass(frozen=True)
class PlannedLayout:
    overrides: dict[str, Any]
    layout: Layout
    closed: SteadyState
    simulated: SimResult
    is_config: bool  # the layout the config already selects
    over_bound: bool  # staleness p99 above the config's bound
    resources: str = ""  # what it uses of a --budget (GPUs, CPUs)

    @property
    def override_args(self) -> list[str]:
        """The overrides as ``labrl train CONFIG`` takes them (``key=value``)."""
        return [f"{k}={v}" for k, v in self.overrides.items()]


@dataclass(frozen=True)
class SamplerCalibration:
    """The sampler a run calibrates: its slots, tokens/s with all busy ``R``, the decode step's ``c``, the fit."""

    kv_slots: int
    tokens_per_s: float
    per_sequence_s: float
    fit: DecodeFit


def sampler_slot_cap(cfg: RunConfig) -> int | None:
    """The sequences the local sampler(s) decode at once: ``max_batch_size`` (x ``ray.samplers`` under Ray);
    ``None`` for SGLang, whose servers' slots labrl does not set."""
    if cfg.sampler.kind != "local":
        return None
    samplers = cfg.ray.samplers if cfg.backend == "ray" else 1
    return cfg.sampler.local.max_batch_size * samplers


def kv_slots(cfg: RunConfig, machines: MachineCalibration, episodes: EpisodeCalibration) -> int:
    """The fixed rate's slots: ``R / r`` rounded, at least 1, at most ``sampler_slot_cap``."""
    slots = max(1, round(machines.sampler_tokens_per_s / episodes.decode_tokens_per_s))
    cap = sampler_slot_cap(cfg)
    return slots if cap is None else min(slots, cap)


def calibrate_sampler(
    cfg: RunConfig, machines: MachineCalibration, episodes: EpisodeCalibration
) -> SamplerCalibration:
    """The batched decoder fitted on the run's generations over ``sampler_slot_cap`` slots, with
    ``R = slots / t(slots)``; where the fit falls back (``DecodeFit.fitted``) or the sampler is SGLang, the
    fixed rate: ``kv_slots`` and the measured ``R``, ``c = 0``."""
    cap = sampler_slot_cap(cfg)
    windows = episodes.windows
    fit = fit_decode(windows, cap if cap is not None else max(1, len(windows)))
    if cap is not None and fit.fitted:
        return SamplerCalibration(cap, fit.sampler_tokens_per_s(cap), fit.per_sequence_s, fit)
    return SamplerCalibration(kv_slots(cfg, machines, episodes), machines.sampler_tokens_per_s, 0.0, fit)


def layout_of(
    cfg: RunConfig,
    machines: MachineCalibration,
    sampler: SamplerCalibration,
    *,
    staleness: int,
    concurrency: int,
) -> Layout:
    p = cfg.pipeline
    return Layout(
        sampler_tokens_per_s=sampler.tokens_per_s,
        kv_slots=sampler.kv_slots,
        env_slots=concurrency,
        learner_step_s=machines.learner_step_s,
        batch_groups=p.batch_groups,
        group_size=p.group_size,
        max_staleness=staleness,
        max_concurrent_episodes=concurrency,
        decode_per_sequence_s=sampler.per_sequence_s,
    )


def with_knobs(base: Layout, *, staleness: int, concurrency: int, env_slot_cap: int | None) -> Layout:
    """``base`` with another staleness bound and episode cap; env calls run one per open episode, at most
    ``env_slot_cap`` at once (an env's pool, ``budgets.pools``) when given."""
    env_slots = concurrency if env_slot_cap is None else min(concurrency, env_slot_cap)
    return replace(base, max_staleness=staleness, max_concurrent_episodes=concurrency, env_slots=env_slots)


def env_slot_cap(env_workers: int, pool: int | None) -> int | None:
    """The env calls ``env_workers`` processes run at once: ``env_workers x min(pool)``; ``None`` (no cap)
    when the env declares no pool (``budget.env_pool_of``)."""
    return None if pool is None else env_workers * pool


def ray_model(cfg: RunConfig, lay: Layout, *, pool: int | None, driver_s_per_episode: float) -> Layout:
    """Under ``backend=ray``, what a Ray run adds to ``lay``: the driver, one server of ``driver_s_per_episode``
    CPU seconds per finished episode, and env slots capped at ``env_slot_cap(ray.env_workers, pool)``.
    In-process layouts are returned as they are."""
    if cfg.backend != "ray":
        return lay
    capped = with_knobs(
        lay,
        staleness=lay.max_staleness,
        concurrency=lay.max_concurrent_episodes,
        env_slot_cap=env_slot_cap(cfg.ray.env_workers, pool),
    )
    return replace(capped, driver_s_per_episode=driver_s_per_episode)


def candidate_overrides(cfg: RunConfig) -> list[dict[str, int]]:
    """The config's own values first, then every other combination of the choices."""
    p = cfg.pipeline
    batch = p.group_size * p.batch_groups
    concurrency = [p.max_concurrent_episodes] + [
        c
        for f in CONCURRENCY_FACTORS
        if (c := min(f * batch, MAX_CONCURRENT_EPISODES)) != p.max_concurrent_episodes
    ]
    if p.mode == "pipeline":
        staleness = [p.max_staleness] + [s for s in STALENESS_CHOICES if s != p.max_staleness]
    else:
        staleness = [p.effective_max_staleness]
    rows = []
    for s in staleness:
        for c in dict.fromkeys(concurrency):
            if c < p.group_size:
                continue
            row = {"pipeline.max_concurrent_episodes": c}
            if p.mode == "pipeline":
                row["pipeline.max_staleness"] = s
            rows.append(row)
    return rows


def run_layout(
    cfg: RunConfig, episode: EpisodeModel, lay: Layout, *, steps: int, seed: int
) -> tuple[SteadyState, SimResult]:
    """The closed form of ``lay`` and its simulation for ``steps`` learner steps at the closed-form rate."""
    closed = steady_state(episode.workload(), lay)
    result = simulate(episode, lay, seconds=steps / closed.steps_per_s, mode=cfg.pipeline.mode, seed=seed)
    return closed, result


def plan(
    cfg: RunConfig,
    episode: EpisodeModel,
    base: Layout,
    *,
    env_slot_cap: int | None = None,
    steps: int = 200,
    seed: int = 0,
) -> list[PlannedLayout]:
    """Every candidate layout (``base`` with each candidate's knobs), simulated for ``steps`` learner steps;
    the best first (``rank_key``)."""
    bound = cfg.pipeline.effective_max_staleness
    out = []
    for i, overrides in enumerate(candidate_overrides(cfg)):
        lay = with_knobs(
            base,
            staleness=overrides.get("pipeline.max_staleness", bound),
            concurrency=overrides["pipeline.max_concurrent_episodes"],
            env_slot_cap=env_slot_cap,
        )
        closed, result = run_layout(cfg, episode, lay, steps=steps, seed=seed)
        out.append(PlannedLayout(dict(overrides), lay, closed, result, i == 0, result.staleness_p99 > bound))
    # among layouts as fast, fewer episodes in flight cost less (env slots, KV cache, paid experiments)
    return sorted(out, key=lambda r: rank_key(r, r.layout.max_concurrent_episodes))


def rate_bucket(steps_per_s: float) -> int:
    """``floor(ln(steps/s) / ln 1.02)``: rates within about 2 % share a bucket (a tie in the ranking)."""
    return math.floor(math.log(steps_per_s) / math.log(1.02)) if steps_per_s > 0 else -(10**9)


def rank_key(row: PlannedLayout, *costs: float) -> tuple[Any, ...]:
    """The ranking of ``plan`` and of the budget search: within the staleness bound first, then faster
    (``rate_bucket``: simulation noise does not decide), then cheaper (``costs``, compared in order),
    then fresher (lower simulated staleness p99)."""
    sim = row.simulated
    return (row.over_bound, -rate_bucket(sim.steps_per_s), *costs, sim.staleness_p99)


def run_header(
    episodes: EpisodeCalibration, machines: MachineCalibration, sampler: SamplerCalibration, bound: int
) -> list[str]:
    """What a run calibrated: three lines."""
    e, w = episodes, episodes.workload()
    return [
        f"calibrated: {e.episodes} episodes in {e.groups} groups, keep rate {w.keep_rate:.2f}, "
        f"{w.turns:.2f} turns x {w.tokens_per_turn:.0f} tokens, env {w.env_s_per_episode:.3f} s per episode",
        f"machines: learner {machines.learner_step_s:.3f} s/step, sampler {sampler.tokens_per_s:.0f} tokens/s "
        f"over {sampler.kv_slots} slots all busy ({e.decode_tokens_per_s:.1f} tokens/s per sequence in the run); "
        f"staleness bound {bound}",
        f"decode: {sampler.fit.reason}",
    ]


def machines_line(lay: Layout, bound: int) -> str:
    driver = f", driver {lay.driver_s_per_episode * 1e3:.1f} ms/episode" if lay.driver_s_per_episode else ""
    return (
        f"machines: learner {lay.learner_step_s:.3f} s/step, sampler {lay.sampler_tokens_per_s:.0f} tokens/s "
        f"over {lay.kv_slots} slots ({lay.decode_tokens_per_s:.1f} tokens/s per sequence){driver}; "
        f"staleness bound {bound}"
    )


def format_plan(rows: list[PlannedLayout], header: list[str], *, bound: int, top: int) -> str:
    """``header``, then the ``top`` layouts (and the config's own, if not among them)."""
    lines = [
        *header,
        f"{'':2}{'steps/s':>9} {'(model)':>9} {'idle: learner':>13} {'sampler':>7} {'env':>5} "
        f"{'staleness p50/p99':>17}  {'binds (model)':<24} overrides",
    ]
    shown = rows[:top] + [r for r in rows[top:] if r.is_config]
    for r in shown:
        sim = r.simulated
        mark = "*" if r.is_config else " "
        flag = f"  ! p99 {sim.staleness_p99:g} > bound {bound}" if r.over_bound else ""
        idle = {k: 1.0 - v for k, v in sim.utilisation.items()}
        uses = f"  [{r.resources}]" if r.resources else ""
        lines.append(
            f"{mark:2}{sim.steps_per_s:9.4g} {r.closed.steps_per_s:9.4g} {idle['learner']:13.2f} "
            f"{idle['sampler']:7.2f} {idle['env']:5.2f} "
            f"{sim.staleness_p50:8g}/{sim.staleness_p99:<8g}  {r.closed.binding:<24} "
            + " ".join(r.override_args)
            + uses
            + flag
        )
    lines.append("* the config's own layout; ! staleness p99 above the config's bound")
    return "\n".join(lines)
