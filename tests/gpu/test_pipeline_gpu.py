"""On a GPU node: 5 steps of `labrl train` with ``sampler.kind: sglang`` against a real SGLang server.

The server is launched by the same supervisor as ``labrl serve sglang``
(``--enable-return-routed-experts --weight-version 0`` added) on an HF export of
the run's model (Qwen3-MoE layout: ``tiny-moe`` with QK-norm), initialised with
another seed than the learner, so the run's initial forced sync is what makes the
first batch on-policy. The checks are the CPU test's
(``tests/sglang/sglang_pipeline_check.py``, fake server) with GPU tolerances:
the server's kernels are not the learner's, so log-probs agree to ~1e-2, and a
near-tie in a router may pick another expert.

Run with ``pytest -m gpu tests/gpu`` (needs CUDA, and SGLang in its own environment: docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest
from sglang_pipeline_check import (
    TINY,
    check_run,
    install_recorder,
    other_init_checkpoint,
    run_config,
)

from labrl.harness.config import build_run_config
from labrl.harness.pipeline.runner import train
from labrl.harness.samplers.sglang.launch import Supervisor, server_command
from labrl.ports import free_port

pytest.importorskip("sglang")

STEPS = 5
# Qwen3-MoE layout (SGLang serves it with routed experts); 4 heads of 32 like the other GPU tests
MODEL = {
    **TINY,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "qk_layernorm": True,
    "max_sequence_length": 256,
}
SERVER_ARGS = ["--mem-fraction-static", "0.2", "--dtype", "float32"]


@pytest.mark.timeout(1800)
async def test_five_pipeline_steps_over_real_sglang(parity_env, tmp_path, monkeypatch):
    run = tmp_path / "run"
    model_cfg = build_run_config(
        run_config(run, ["http://unused"], steps=STEPS, model_overrides=MODEL)
    ).model.resolve()
    ckpt = other_init_checkpoint(model_cfg, tmp_path / "served", arch="qwen3_moe")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(
        str(ckpt), "127.0.0.1", port, SERVER_ARGS, launcher=f"{sys.executable} -m sglang.launch_server"
    )
    sup = Supervisor(cmd, url, ready_timeout_s=900, max_restarts=0)
    await asyncio.to_thread(sup.start)
    try:
        recorder = install_recorder(monkeypatch)
        cfg = build_run_config(run_config(run, [url], steps=STEPS, model_overrides=MODEL))
        summary = await train(cfg)
        async with httpx.AsyncClient(timeout=30) as client:
            served_version = (await client.get(url + "/model_info")).json()["weight_version"]
    finally:
        sup.stop()
    assert summary["step"] == STEPS and not summary["interrupted"]
    measured = check_run(
        run,
        recorder,
        steps=STEPS,
        server_weight_version=str(served_version),
        min_agreement=0.95,
        max_logprob_gap=2e-2,
    )
    print(f"pipeline over SGLang (GPU): {measured}")
