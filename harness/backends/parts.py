"""The parts of a run, built from a ``RunConfig``: tokenizer, env factory, learner, sampler, warm start.

Both backends build with these functions: the in-process backend in the
driver, the Ray backend inside its actors (the learner actor builds the
learner and runs the warm start, each sampler actor its sampler, each env
worker its env factory and tokenizer). One function per part, so a run is
the same whichever process holds a part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from labrl.errors import ConfigError
from labrl.harness.config import ComponentConfigs, RunConfig, component_configs
from labrl.harness.pipeline.overlong import BudgetForcingSampler
from labrl.harness.samplers.local import LocalSamplerConfig
from labrl.harness.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from labrl.harness.types import Sampler

if TYPE_CHECKING:
    from labrl.envs.base import Env
    from labrl.harness.learners import MegatronLearner
    from labrl.harness.models.config import MoEModelConfig
    from labrl.harness.samplers.sglang.sampler import SGLangSamplerConfig

#: a cascade env's budget ledger in the run directory, unless ``cascade.ledger_path`` names another
CASCADE_LEDGER_FILE = "cascade-ledger.sqlite"
#: makes a fresh env of the run (``envs.make`` with the run's id, budgets and options)
EnvFactory = Callable[[], "Env"]
#: called with each warm-start record (``{"sft_step", "loss", "time_s"}``)
OnSFTStep = Callable[[dict[str, Any]], None]
#: polled between warm-start steps: True ends the warm start early
ShouldStop = Callable[[], bool]


def make_env_factory(cfg: RunConfig) -> EnvFactory:
    """The run's env factory; one env is made at once, so a bad id or option fails here, before anything is built.

    A cascade env whose ``cascade.ledger_path`` is unset gets ``RUN_DIR/cascade-ledger.sqlite``: the
    ledger lives with the run, so a resumed run (same ``run_dir``) finds what it already paid for.
    """
    from labrl.envs import make
    from labrl.envs.cascade import CascadeEnv

    budgets = cfg.env.budgets or None
    options = dict(cfg.env.options)
    if cfg.cascade is not None:  # the cascade component's section reaches the env as its option
        if "cascade" in options:
            raise ConfigError(
                "set the cascade either as the cascade: section or as env.options.cascade, not both"
            )
        options["cascade"] = cfg.cascade.model_dump(mode="json")

    def factory() -> Env:
        return make(cfg.env.id, budgets=budgets, **options)

    inner = factory().unwrapped
    if isinstance(inner, CascadeEnv) and inner.cascade.ledger_path is None:
        ledger = str(Path(cfg.run_dir) / CASCADE_LEDGER_FILE)
        options["cascade"] = inner.cascade.model_copy(update={"ledger_path": ledger}).model_dump(mode="json")
    return factory


def build_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The byte tokenizer of the from-scratch presets, or the tokenizer shipped with ``model.init_from_hf``."""
    if cfg.model.init_from_hf is None:
        return ByteTokenizer()
    return HFTokenizer(cfg.model.init_from_hf)


def run_components(cfg: RunConfig, tokenizer: Tokenizer | None = None) -> ComponentConfigs:
    """The component configs of this run (``labrl.harness.config.component_configs``)."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg)
    return component_configs(cfg, model=cfg.model.resolve(), pad_token_id=tokenizer.pad_token_id)


def build_learner(cfg: RunConfig, tokenizer: Tokenizer | None = None) -> MegatronLearner:
    from labrl.harness.learners import MegatronLearner

    return MegatronLearner(run_components(cfg, tokenizer).learner)


def initialise_from_hf(learner: MegatronLearner, path: str, model_cfg: MoEModelConfig) -> None:
    """Load a Hugging Face MoE checkpoint's weights into the learner's megatron-core model."""
    from labrl.harness.models.hf_import import load_hf_checkpoint, load_into_model

    load_into_model(learner.model, load_hf_checkpoint(path, model_cfg))


async def warm_start(
    learner: MegatronLearner,
    cfg: RunConfig,
    tokenizer: Tokenizer,
    make_env: EnvFactory,
    *,
    on_sft: OnSFTStep | None = None,
    should_stop: ShouldStop | None = None,
) -> float:
    """A fresh run's start: ``model.init_from_hf`` weights, then the format-only SFT (``sft.enabled``).

    Returns the SFT's wall seconds (0 without SFT). ``should_stop`` is polled
    before each SFT step; True ends the warm start early (``on_sft`` has then
    seen fewer than ``sft.steps`` records).
    """
    if cfg.model.init_from_hf is not None:
        initialise_from_hf(learner, cfg.model.init_from_hf, cfg.model.resolve())
    if not cfg.sft.enabled:
        return 0.0
    from labrl.harness.rollout.sft import run_sft

    t0 = time.perf_counter()
    await run_sft(
        learner.model, make_env, tokenizer, cfg.sft, seed=cfg.seed, on_step=on_sft, should_stop=should_stop
    )
    return time.perf_counter() - t0


async def build_sampler(cfg: RunConfig, learner: MegatronLearner, tokenizer: Tokenizer) -> Sampler:
    """The run's sampler, holding the learner's current weights and version."""
    return await build_sampler_from(cfg, learner.export_weights(), learner.version, tokenizer)


async def build_sampler_from(
    cfg: RunConfig,
    weights: Mapping[str, torch.Tensor],
    version: int,
    tokenizer: Tokenizer,
    *,
    sampler_cfg: LocalSamplerConfig | SGLangSamplerConfig | None = None,
) -> Sampler:
    """A sampler holding ``weights`` as policy ``version``, wrapped for ``pipeline.overlong.mode=force``.

    ``sampler_cfg`` replaces the run's sampler config (``run_components(cfg).sampler``),
    e.g. with the share of ``sampler.sglang.urls`` one of several samplers fronts.
    """
    components = run_components(cfg, tokenizer)
    sampler_cfg = sampler_cfg if sampler_cfg is not None else components.sampler
    sampler: Sampler
    if isinstance(sampler_cfg, LocalSamplerConfig):
        from labrl.harness.samplers.local import LocalSampler

        sampler = LocalSampler(components.model, sampler_cfg, weights=weights, version=version)
    else:
        from labrl.harness.samplers.sglang.sampler import make_sglang_sampler

        # both transports move hf_export.hf_weights of the learner's weights (HF names, training dtype)
        sglang = make_sglang_sampler(sampler_cfg, components.model)
        # The servers hold whatever they were launched with (or a previous run's weights):
        # set them to the learner's weights and version, which may not be newer.
        await sglang.start()
        await sglang.update_weights(weights, version, force=True)
        sampler = sglang
    overlong = cfg.pipeline.overlong
    if overlong.mode == "force":
        sampler = BudgetForcingSampler(sampler, tokenizer.encode(overlong.cue), overlong.answer_tokens)
    return sampler
