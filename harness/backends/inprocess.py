"""``backend=inprocess`` (the default): the learner, the sampler and every episode in this process."""

from __future__ import annotations

from labrl.harness.backends import parts
from labrl.harness.backends.base import RunParts, RunStart


class InProcessBackend:
    """Builds the learner here, warm-starts it (fresh runs), then a sampler holding its weights."""

    async def start(self, run: RunStart) -> RunParts:
        # through the module, so a test's monkeypatched builder is the one used
        learner = parts.build_learner(run.cfg)
        sft_s = 0.0
        if not run.resume:  # a resumed run loads its own checkpoint instead
            sft_s = await parts.warm_start(
                learner, run.cfg, run.tokenizer, run.make_env, on_sft=run.on_sft, should_stop=run.should_stop
            )
        sampler = await parts.build_sampler(run.cfg, learner, run.tokenizer)
        return RunParts(learner=learner, sampler=sampler, sft_s=sft_s)
