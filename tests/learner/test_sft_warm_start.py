"""The warm start's lr schedule (warmup) and how fast it honours a stop."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from pydantic import ValidationError

from labrl.envs import make
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import get_preset
from labrl.harness.rollout.sft import SFTSection, run_sft
from labrl.harness.tokenizer import ByteTokenizer

SMALL = get_preset("tiny-moe").model_copy(
    update={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 32}
)


def _sft(cfg: SFTSection, **kw) -> list[dict]:
    learner = MegatronLearner(LearnerConfig(model=SMALL))
    return asyncio.run(run_sft(learner.model, lambda: make("xrd/phase-id-v0"), ByteTokenizer(), cfg, **kw))


@pytest.mark.timeout(300)
def test_warmup_ramps_the_lr_linearly_then_holds_it():
    cfg = SFTSection(enabled=True, steps=4, warmup_steps=2, lr=3e-3, batch_size=2, num_prompts=4)
    lrs = [r["lr"] for r in _sft(cfg)]
    # (step + 1) / (warmup + 1) of lr during the warmup, the learner's rule
    assert lrs == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3], rel=1e-12)


@pytest.mark.timeout(300)
def test_cosine_after_warmup_decays_to_the_floor_at_the_last_step():
    cfg = SFTSection(
        enabled=True,
        steps=4,
        warmup_steps=1,
        lr=1e-3,
        schedule="cosine",
        min_lr_ratio=0.1,
        batch_size=2,
        num_prompts=4,
    )
    lrs = [r["lr"] for r in _sft(cfg)]
    # warmup 1/2; then progress 0, 1/3, 2/3 of the 3 steps after it: 0.1 + 0.9 (1 + cos(pi p)) / 2
    assert lrs == pytest.approx([5e-4, 1e-3, 7.75e-4, 3.25e-4], rel=1e-9)


def test_warmup_must_end_before_the_last_step():
    with pytest.raises(ValidationError, match=r"sft.warmup_steps=5 >= sft.steps=5"):
        SFTSection(steps=5, warmup_steps=5)
    with pytest.raises(ValidationError):
        SFTSection(warmup_steps=-1)
    assert SFTSection().warmup_steps == 0  # the quickstart's warm start is unchanged by the field


@pytest.mark.timeout(300)
def test_a_signal_during_a_step_stops_the_warm_start_after_that_step():
    """SIGINT lands while step 1 ends (from ``on_step``): the handler runs during step 2, so the warm
    start stops after 2 steps. With the step on the loop and one ``sleep(0)`` between steps, asyncio
    needs three turns to run the handler, and steps 2 and 3 both ran."""
    cfg = SFTSection(enabled=True, steps=6, batch_size=2, num_prompts=4)
    learner = MegatronLearner(LearnerConfig(model=SMALL))
    asked: list[str] = []

    def on_step(record: dict) -> None:
        if record["sft_step"] == 1:
            os.kill(os.getpid(), signal.SIGINT)

    async def go() -> list[dict]:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, asked.append, "SIGINT")
        try:
            return await run_sft(
                learner.model,
                lambda: make("xrd/phase-id-v0"),
                ByteTokenizer(),
                cfg,
                on_step=on_step,
                should_stop=lambda: bool(asked),
            )
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    history = asyncio.run(go())
    assert asked == ["SIGINT"]
    assert [r["sft_step"] for r in history] == [1, 2]


@pytest.mark.timeout(300)
def test_each_worker_thread_makes_the_model_device_current(monkeypatch, h):
    """CUDA's current device is per thread and a new thread starts on device 0, so the warm-start
    step, the learner's step and its export (all run in worker threads) make the model's device
    current in the thread that computes (``make_current`` is a no-op on CPU: recorded here)."""
    import threading

    import torch

    from labrl.harness.models import device as dev

    calls: list[tuple[str, int]] = []
    real = dev.make_current

    def record(device: torch.device) -> None:
        calls.append((str(device), threading.get_ident()))
        real(device)

    monkeypatch.setattr(dev, "make_current", record)
    learner = MegatronLearner(LearnerConfig())  # the tiny preset: h's sampler builds that shape
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=2, max_new=4)
    calls.clear()  # building the model makes its device current on this thread too
    cfg = SFTSection(enabled=True, steps=2, batch_size=2, num_prompts=4)
    asyncio.run(run_sft(learner.model, lambda: make("xrd/phase-id-v0"), ByteTokenizer(), cfg))
    main = threading.get_ident()
    assert len(calls) == 2 and all(d == "cpu" and t != main for d, t in calls)
    calls.clear()
    asyncio.run(asyncio.to_thread(learner.export_weights))
    asyncio.run(asyncio.to_thread(learner.train_step, batch))
    assert [d for d, _ in calls] == ["cpu", "cpu"] and all(t != main for _, t in calls)
