"""Calibration without a run: an episode model from the config and the env's spec, machines from figures.

The episode (every value an assumption, printed as such by ``describe``):

- turns ``k = budgets.max_turns`` and tokens per turn ``m = sampler.max_new_tokens``: every episode
  uses its whole budget (an upper bound on the sampler's work);
- each env step a lognormal call, median ``env_step_s`` and ``sigma`` (``figures.DEFAULTS`` unless
  given), cut at ``budgets.step_timeout_s`` (the budget ends a call there); the reset costs nothing
  (no env declares its latency: ``EnvSpec`` has no field for it);
- the keep rate of ``figures``.

The machines (``Hardware`` says what runs where), with ``P`` the model's active matmul parameters
and each figure moved to ``P`` (``Figure.for_model``):

- learner ``D = B G L_ctx / (max(1, learner_gpus) x learner tokens/s)``, ``L_ctx`` the model's
  ``max_sequence_length`` (rows padded to the context: an upper bound), the per-GPU rate times the
  GPUs (data parallel, assumed linear), or the CPU figure without GPUs;
- sampler ``R = samplers x`` one sampler's tokens/s (local: the local sampler's GPU or CPU figure;
  SGLang: one server per URL of ``sampler.sglang.urls``, each ``launch_tp_size`` GPUs at the per-GPU
  figure), over ``samplers x`` slots (local: ``sampler.local.max_batch_size``; SGLang: the
  slots-per-GPU figure times its GPUs);
- the driver's CPU seconds per episode.
"""

from __future__ import annotations

from dataclasses import dataclass

from labrl.envs.types import Budgets
from labrl.errors import ConfigError
from labrl.harness.config import RunConfig
from labrl.harness.planning.draws import Constant, LogNormal
from labrl.harness.planning.figures import Figure
from labrl.harness.planning.model import Layout
from labrl.harness.planning.simulate import EpisodeModel


@dataclass(frozen=True)
class Hardware:
    """What runs the learner and the samplers (the ``ray.`` keys of the same names)."""

    learner_gpus: int  # 0: the learner on CPU
    samplers: int
    gpus_per_sampler: int  # 0: samplers on CPU

    def __post_init__(self) -> None:
        if self.learner_gpus < 0 or self.samplers < 1 or self.gpus_per_sampler < 0:
            raise ConfigError(f"learner_gpus >= 0, samplers >= 1 and gpus_per_sampler >= 0 (got {self})")

    @property
    def gpus(self) -> int:
        return self.learner_gpus + self.samplers * self.gpus_per_sampler


@dataclass(frozen=True)
class PriorMachines:
    learner_step_s: float
    sampler_tokens_per_s: float
    kv_slots: int
    driver_s_per_episode: float


def prior_episode(
    cfg: RunConfig,
    budgets: Budgets,
    figures: dict[str, Figure],
    *,
    env_step_s: float | None = None,
    env_sigma: float | None = None,
) -> EpisodeModel:
    """The episode model of the module docstring."""
    median = figures["env_step_median_s"].value if env_step_s is None else env_step_s
    sigma = figures["env_step_sigma"].value if env_sigma is None else env_sigma
    if median <= 0 or sigma < 0:
        raise ConfigError(f"the env step's median must be > 0 and its sigma >= 0 (got {median}, {sigma})")
    return EpisodeModel(
        turns=Constant(budgets.max_turns),
        tokens_per_turn=Constant(cfg.sampler.max_new_tokens),
        env_s=LogNormal(median, sigma, cap=budgets.step_timeout_s),
        keep_rate=figures["keep_rate"].value,
        reset_s=Constant(0.0),
    )


def learner_figure(figures: dict[str, Figure], hw: Hardware) -> Figure:
    return figures["learner_tokens_per_s_gpu" if hw.learner_gpus else "learner_tokens_per_s_cpu"]


def sampler_figure(cfg: RunConfig, figures: dict[str, Figure], hw: Hardware) -> Figure:
    if cfg.sampler.kind == "sglang":
        return figures["sglang_tokens_per_s_gpu"]
    return figures[
        "local_sampler_tokens_per_s_gpu" if hw.gpus_per_sampler else "local_sampler_tokens_per_s_cpu"
    ]


def prior_machines(cfg: RunConfig, figures: dict[str, Figure], hw: Hardware) -> PriorMachines:
    """The machines of the module docstring for ``hw``."""
    model = cfg.model.resolve()
    params = model.active_matmul_parameter_count
    p = cfg.pipeline
    learner_tokens_per_s = max(1, hw.learner_gpus) * learner_figure(figures, hw).for_model(params)
    sglang = cfg.sampler.kind == "sglang"
    per_sampler_slots = (
        int(figures["sglang_slots_per_gpu"].value) * hw.gpus_per_sampler
        if sglang
        else cfg.sampler.local.max_batch_size
    )
    per_sampler = sampler_figure(cfg, figures, hw).for_model(params) * (hw.gpus_per_sampler if sglang else 1)
    return PriorMachines(
        learner_step_s=p.batch_groups * p.group_size * model.max_sequence_length / learner_tokens_per_s,
        sampler_tokens_per_s=hw.samplers * per_sampler,
        kv_slots=hw.samplers * per_sampler_slots,
        driver_s_per_episode=figures["driver_s_per_episode"].value,
    )


def describe(
    cfg: RunConfig,
    budgets: Budgets,
    episode: EpisodeModel,
    figures: dict[str, Figure],
    hw: Hardware,
    *,
    env_given: bool,
) -> list[str]:
    """The assumptions, one line each, with where each figure comes from (``env_given``: the env step's
    median and sigma were given, not taken from ``figures``)."""
    env = episode.env_s
    assert isinstance(env, LogNormal)
    params = cfg.model.resolve().active_matmul_parameter_count
    used = [learner_figure(figures, hw), sampler_figure(cfg, figures, hw), figures["driver_s_per_episode"]]
    lines = [
        "no run to calibrate from: every figure below is assumed",
        f"episode: {budgets.max_turns} turns (env budgets.max_turns) x {cfg.sampler.max_new_tokens} tokens "
        f"(sampler.max_new_tokens), env step lognormal median {env.median:g} s sigma {env.sigma:g} "
        f"cut at {env.cap:g} s (budgets.step_timeout_s), reset 0 s, keep rate {episode.keep_rate:g}",
    ]
    if not env_given:
        lines.append(f"  env step: {figures['env_step_median_s'].source}")
    lines.append(f"  keep rate: {figures['keep_rate'].source}")
    lines += [figure_line(f, params) for f in used]
    return lines


def sglang_servers(cfg: RunConfig) -> tuple[int, int]:
    """The SGLang servers the config names and the GPUs of each: ``len(urls)``, ``launch_tp_size``."""
    sg = cfg.sampler.sglang
    return len(sg.urls), sg.launch_tp_size


def figure_line(f: Figure, params: int) -> str:
    """One figure, how it moves to a model of ``params`` active parameters, and where it comes from."""
    moved = (
        f" on {f.active_params:,} active parameters, x {f.active_params / params:.3g} for this model's {params:,}"
        if f.active_params
        else ""
    )
    return f"  {f.value:,.4g} {f.unit}{moved}: {'recorded' if f.recorded else 'default'}, {f.source}"


def search_figure_keys(cfg: RunConfig) -> list[str]:
    """The figures a ``--budget`` search may use for ``cfg``: learner on GPU or CPU, its samplers, the driver."""
    samplers = (
        ["sglang_tokens_per_s_gpu", "sglang_slots_per_gpu"]
        if cfg.sampler.kind == "sglang"
        else ["local_sampler_tokens_per_s_gpu", "local_sampler_tokens_per_s_cpu"]
    )
    return ["learner_tokens_per_s_gpu", "learner_tokens_per_s_cpu", *samplers, "driver_s_per_episode"]


def config_hardware(cfg: RunConfig) -> Hardware:
    """What the config runs on: ``ray.learner_gpus`` and ``ray.samplers`` (on GPU when ``ray.gpus_per_sampler``
    > 0) under Ray; in-process, one learner and one sampler on ``learner.device`` (``auto``: this machine's;
    they share it, and the model gives each its full rate: optimistic);
    with SGLang, its servers (``sglang_servers``)."""
    if cfg.sampler.kind == "sglang":
        learner = cfg.ray.learner_gpus if cfg.backend == "ray" else 1
        return Hardware(learner, *sglang_servers(cfg))
    if cfg.backend == "ray":
        r = cfg.ray
        return Hardware(r.learner_gpus, r.samplers, 1 if r.gpus_per_sampler > 0 else 0)
    device = cfg.learner.device
    if device == "auto":
        import torch

        gpu = torch.cuda.is_available()
    else:
        gpu = device.startswith("cuda")
    return Hardware(int(gpu), 1, int(gpu))


def prior_layout(cfg: RunConfig, figures: dict[str, Figure], hw: Hardware) -> Layout:
    """The config's own layout on ``hw``'s machines (``prior_machines``); env slots its episode cap."""
    m = prior_machines(cfg, figures, hw)
    p = cfg.pipeline
    return Layout(
        sampler_tokens_per_s=m.sampler_tokens_per_s,
        kv_slots=m.kv_slots,
        env_slots=p.max_concurrent_episodes,
        learner_step_s=m.learner_step_s,
        batch_groups=p.batch_groups,
        group_size=p.group_size,
        max_staleness=p.effective_max_staleness,
        max_concurrent_episodes=p.max_concurrent_episodes,
        driver_s_per_episode=m.driver_s_per_episode,
    )
