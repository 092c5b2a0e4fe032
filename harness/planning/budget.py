"""``labrl plan --budget gpus=N,cpus=M``: the Ray layouts that fit a budget, ranked by predicted steps/s.

A layout is the ``backend=ray`` overrides ``ray.learner_gpus``, ``ray.samplers``,
``ray.gpus_per_sampler``, ``ray.env_workers`` plus ``pipeline.max_staleness`` and
``pipeline.max_concurrent_episodes``. It fits when

    GPUs: learner_gpus + samplers x gpus_per_sampler <= N
    CPUs: 1 (the driver) + ray.learner_cpus + samplers x ray.cpus_per_sampler
          + env_workers x ray.cpus_per_env_worker <= M

The choices: ``n`` GPUs in use, ``n`` a power of two or ``N``; of them the learner's in powers of
two below ``n`` and ``n - 1``, the other GPUs one sampler each (``gpus_per_sampler = 1``), or all
``n`` the learner's with CPU samplers in powers of two. With ``sampler.kind=sglang`` the samplers
are the config's servers (one per URL of ``sampler.sglang.urls``, ``launch_tp_size`` GPUs each;
labrl does not place them, so their actors hold no GPU): only the learner's GPUs vary, from what
the servers leave. Env workers in powers of two when the env declares a pool (``budgets.pools``:
at most ``min(pool)`` env calls per worker process, so env slots ``= min(max_concurrent_episodes,
env_workers x min(pool))``), else one (an env worker runs any number of calls at once and its CPU
is not modelled). Learner GPUs a multiple of ``TP x EP x PP`` (``parallel``: megatron-core's groups
must divide them). Staleness bounds up to the config's (``pipeline`` mode); episode caps of 1, 2,
4 and 8 batches. The machines come from ``priors.prior_machines``.

Every layout's closed form (``model``) is computed; for each pair of staleness bound and episode cap
the best by it (least resources first among equals) are simulated, ``simulate`` in all. Ranked: layouts whose simulated
staleness p99 is within the config's bound first, then by simulated steps/s, rates within 2 % a tie
(``rate_bucket``: ``floor(ln(steps/s) / ln 1.02)``), then fewer GPUs, fewer CPUs, fewer episodes at
once, lower p99.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labrl.envs.types import Budgets
from labrl.errors import ConfigError
from labrl.harness.config import RunConfig
from labrl.harness.pipeline.config import MAX_CONCURRENT_EPISODES
from labrl.harness.planning.figures import Figure
from labrl.harness.planning.model import Layout, steady_state
from labrl.harness.planning.plan import (
    STALENESS_CHOICES,
    PlannedLayout,
    env_slot_cap,
    rank_key,
    rate_bucket,
    run_layout,
    with_knobs,
)
from labrl.harness.planning.priors import Hardware, prior_layout, sglang_servers
from labrl.harness.planning.simulate import EpisodeModel

BATCH_FACTORS = (1, 2, 4, 8)  # episode caps, x the episodes of one batch


class Budget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(ge=0, le=1_000_000)
    cpus: int = Field(ge=1, le=10_000_000)


def parse_budget(text: str) -> Budget:
    """``gpus=N,cpus=M`` (both, integers, any order) as a ``Budget``; anything else a ``ConfigError``."""
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--budget {text!r}: expected gpus=N,cpus=M (got item {item.strip()!r})")
        if key in fields:
            raise ConfigError(f"--budget {text!r}: {key} given twice")
        fields[key] = value
    try:
        return Budget.model_validate({k: int(v) if v.isdigit() else v for k, v in fields.items()})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"--budget {text!r}: {problems} (expected gpus=N,cpus=M)") from None


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` (none when ``limit < 1``)."""
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


@dataclass(frozen=True)
class Candidate:
    hardware: Hardware
    env_workers: int
    staleness: int
    concurrency: int

    def cpus(self, cfg: RunConfig) -> float:
        r = cfg.ray
        return (
            1
            + r.learner_cpus
            + self.hardware.samplers * r.cpus_per_sampler
            + self.env_workers * r.cpus_per_env_worker
        )

    def overrides(self, cfg: RunConfig) -> dict[str, Any]:
        hw = self.hardware
        out: dict[str, Any] = {
            "backend": "ray",
            "ray.learner_gpus": hw.learner_gpus,
            "ray.samplers": hw.samplers,
            # an SGLang server's GPUs are its own, not its sampler actor's
            "ray.gpus_per_sampler": 0 if cfg.sampler.kind == "sglang" else hw.gpus_per_sampler,
            "ray.env_workers": self.env_workers,
            "pipeline.max_concurrent_episodes": self.concurrency,
        }
        if cfg.pipeline.mode == "pipeline":
            out["pipeline.max_staleness"] = self.staleness
        return out


def hardware_choices(budget: Budget, cpu_room: int, sglang: tuple[int, int] | None = None) -> list[Hardware]:
    """Learner GPUs and samplers within ``budget`` (module docstring); ``cpu_room`` CPUs for CPU samplers;
    ``sglang``: the config's SGLang servers and GPUs each, fixed, the learner's GPUs what is left."""
    if sglang is not None:
        servers, tp = sglang
        left = budget.gpus - servers * tp
        learner = sorted(set(powers_of_two(left)) | ({left} if left > 0 else set()))
        return [Hardware(g, servers, tp) for g in learner]
    cpu_samplers = powers_of_two(cpu_room)
    if budget.gpus == 0:
        return [Hardware(0, n, 0) for n in cpu_samplers]
    out = []
    for total in sorted(set(powers_of_two(budget.gpus)) | {budget.gpus}):
        learner = sorted(set(powers_of_two(total - 1)) | ({total - 1} if total > 1 else set()))
        out += [Hardware(g, total - g, 1) for g in learner]
        out += [Hardware(total, n, 0) for n in cpu_samplers]
    return out


def candidates(cfg: RunConfig, budget: Budget, env_pool: int | None) -> list[Candidate]:
    """Every layout of the module docstring that fits ``budget``."""
    p, r = cfg.pipeline, cfg.ray
    fixed = 1 + r.learner_cpus
    batch = p.group_size * p.batch_groups
    concurrency = sorted({min(f * batch, MAX_CONCURRENT_EPISODES) for f in BATCH_FACTORS})
    if p.mode == "pipeline":
        staleness = sorted({s for s in STALENESS_CHOICES if s <= p.max_staleness} | {p.max_staleness})
    else:
        staleness = [p.effective_max_staleness]
    cpu_room = int((budget.cpus - fixed - r.cpus_per_env_worker) // max(r.cpus_per_sampler, 1e-9))
    out = []
    par = cfg.parallel
    unit = par.tensor_parallel * par.expert_parallel * par.pipeline_parallel
    choices = hardware_choices(
        budget, cpu_room, sglang_servers(cfg) if cfg.sampler.kind == "sglang" else None
    )
    for hw in [h for h in choices if h.learner_gpus % unit == 0]:
        room = budget.cpus - fixed - hw.samplers * r.cpus_per_sampler
        workers = powers_of_two(int(room // max(r.cpus_per_env_worker, 1e-9))) if env_pool else [1]
        for w in workers:
            cand_cpus = fixed + hw.samplers * r.cpus_per_sampler + w * r.cpus_per_env_worker
            if hw.gpus > budget.gpus or cand_cpus > budget.cpus:
                continue
            out += [Candidate(hw, w, s, c) for s in staleness for c in concurrency]
    if not out and cfg.sampler.kind == "sglang":
        servers, tp = sglang_servers(cfg)
        raise ConfigError(
            f"no layout fits gpus={budget.gpus},cpus={budget.cpus}: the config's {servers} SGLang server(s) of "
            f"{tp} GPU(s) (sampler.sglang.urls, launch_tp_size) leave no GPU for the learner, or too few CPUs"
        )
    if not out:
        raise ConfigError(
            f"no layout fits gpus={budget.gpus},cpus={budget.cpus}: a Ray run needs at least "
            f"{fixed + r.cpus_per_sampler + r.cpus_per_env_worker:g} CPUs (driver, learner, a sampler, an env worker)"
        )
    return out


def layout_for(cfg: RunConfig, cand: Candidate, figures: dict[str, Figure], env_pool: int | None) -> Layout:
    """``cand`` on the machines of ``priors``; env slots ``min(cap, env_workers x pool)`` (module docstring)."""
    return with_knobs(
        prior_layout(cfg, figures, cand.hardware),
        staleness=cand.staleness,
        concurrency=cand.concurrency,
        env_slot_cap=env_slot_cap(cand.env_workers, env_pool),
    )


def env_pool_of(budgets: Budgets) -> int | None:
    """The env calls one process runs at once: its smallest pool, or ``None`` when it declares none."""
    return min(budgets.pools.values()) if budgets.pools else None


def search(
    cfg: RunConfig,
    budget: Budget,
    episode: EpisodeModel,
    budgets: Budgets,
    figures: dict[str, Figure],
    *,
    simulate: int = 24,
    steps: int = 100,
    seed: int = 0,
) -> list[PlannedLayout]:
    """The layouts of ``budget``, ranked as the module docstring says (the simulated ones only)."""
    pool = env_pool_of(budgets)
    workload = episode.workload()
    bound = cfg.pipeline.effective_max_staleness
    scored = []
    for cand in candidates(cfg, budget, pool):
        lay = layout_for(cfg, cand, figures, pool)
        scored.append((cand, lay, steady_state(workload, lay)))
    scored.sort(key=lambda t: (-rate_bucket(t[2].steps_per_s), t[0].hardware.gpus, t[0].cpus(cfg)))
    # the closed form ties layouts that admission or the episode cap bind whatever their machines, and
    # the simulator tells them apart: so each pair of knobs gets its best few, not the overall best
    knobs = sorted({(c.staleness, c.concurrency) for c, _, _ in scored})
    per_knobs = -(-simulate // len(knobs))
    chosen = [
        t for k in knobs for t in [t for t in scored if (t[0].staleness, t[0].concurrency) == k][:per_knobs]
    ]
    ranked = []
    for cand, lay, _ in chosen:
        closed, result = run_layout(cfg, episode, lay, steps=steps, seed=seed)
        uses = f"{cand.hardware.gpus} GPUs, {cand.cpus(cfg):g} CPUs"
        row = PlannedLayout(
            cand.overrides(cfg), lay, closed, result, False, result.staleness_p99 > bound, uses
        )
        ranked.append((rank_key(row, cand.hardware.gpus, cand.cpus(cfg), cand.concurrency), row))
    return [row for _, row in sorted(ranked, key=lambda kr: kr[0])]
