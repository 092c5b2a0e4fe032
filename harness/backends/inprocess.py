"""``backend=inprocess`` (the default): the learner, the sampler and every episode in this process."""

from __future__ import annotations

from labrl.harness.backends import parts
from labrl.harness.backends.base import RunParts
from labrl.harness.backends.parts import EnvFactory, OnSFTStep, ShouldStop
from labrl.harness.config import RunConfig
from labrl.harness.tokenizer import Tokenizer


class InProcessBackend:
    """Builds the learner here, warm-starts it (fresh runs), then a sampler holding its weights."""

    async def start(
        self,
        cfg: RunConfig,
        tokenizer: Tokenizer,
        make_env: EnvFactory,
        *,
        resume: bool,
        on_sft: OnSFTStep,
        should_stop: ShouldStop,
    ) -> RunParts:
        # through the module, so a test's monkeypatched builder is the one used
        learner = parts.build_learner(cfg)
        sft_s = 0.0
        if not resume:  # a resumed run loads its own checkpoint instead
            sft_s = await parts.warm_start(
                learner, cfg, tokenizer, make_env, on_sft=on_sft, should_stop=should_stop
            )
        sampler = await parts.build_sampler(cfg, learner, tokenizer)
        return RunParts(learner=learner, sampler=sampler, sft_s=sft_s)
