"""`labrl train` with ``sampler.kind: sglang`` on CPU, against the fake SGLang server.

The server runs in a thread of this process (``ServerThread``) and serves an HF checkpoint with
``LocalSampler``; it starts from a checkpoint that is NOT the learner's (another init seed), so the
run's initial sync (export -> ``update_weights_from_disk``, forced to version 0) is what makes the
first batch's behaviour log-probs equal the learner's. Every later step moves the weights the same
way, in flight (pause retract -> update from disk -> continue). Checks: ``sglang_pipeline_check``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sglang_pipeline_check import check_run, install_recorder, other_init_checkpoint, run_config

from labrl.harness.config import build_run_config, load_run_config
from labrl.harness.pipeline.runner import train
from labrl.testing.fake_sglang_server import ServerThread, export_run_model, local_fake_server

STEPS = 4


@pytest.mark.timeout(180)
async def test_train_over_fake_sglang_server(parity_env, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    # the server's URL is not known yet; the model shape does not depend on it
    model_cfg = build_run_config(run_config(run, ["http://unused"], steps=STEPS)).model.resolve()
    ckpt = other_init_checkpoint(model_cfg, tmp_path / "served")
    # a small per-token delay keeps generations running while the learner trains, so updates
    # land mid-generation as they do on a busy GPU server
    server = local_fake_server(str(ckpt), tick_delay_s=0.01)
    recorder = install_recorder(monkeypatch)
    with ServerThread(server.app) as url:
        cfg = build_run_config(run_config(run, [url], steps=STEPS))
        summary = await train(cfg)
    assert summary["step"] == STEPS and not summary["interrupted"]
    assert server.weights.skipped == []  # every exported name loaded (SGLang would skip others silently)
    measured = check_run(
        run,
        recorder,
        steps=STEPS,
        server_weight_version=server.weight_version,
        min_agreement=0.98,
        max_logprob_gap=1e-3,
    )
    # updates landed mid-generation: some episodes hold tokens of two versions (spans from the server)
    assert measured["multi_version_rows"] > 0
    # every update went pause(retract) -> update_weights_from_disk -> continue, versions 0..STEPS
    updates = [e for e in server.log if e.startswith("update_")]
    assert updates == [f"update_disk:{v}" for v in range(STEPS + 1)]
    for i, entry in enumerate(server.log):
        if entry.startswith("update_"):
            assert server.log[i - 1] == "pause:retract" and server.log[i + 1] == "continue"
    # the sampler wrote HF checkpoints and kept the newest two
    exports = sorted(p.name for p in (run / "exports").iterdir())
    assert exports == [f"v{STEPS - 1:06d}", f"v{STEPS:06d}"]
    assert json.loads((run / "exports" / exports[-1] / "config.json").read_text())["num_hidden_layers"] == 2
    print(f"pipeline over fake SGLang: {measured}")


def test_quickstart_sglang_config_exports_a_servable_model(tmp_path):
    """``fake_server --run-config configs/quickstart-sglang.yaml`` serves that run's architecture."""
    config = Path(__file__).parents[2] / "configs" / "quickstart-sglang.yaml"
    cfg = load_run_config(config)
    assert cfg.sampler.kind == "sglang" and cfg.sampler.sglang.export_dir == "runs/quickstart-sglang/exports"
    path = export_run_model(str(config), str(tmp_path / "served"))
    server = local_fake_server(path)
    model_cfg = cfg.model.resolve()
    # the quickstart's task and model (configs/quickstart.yaml), served over SGLang's API
    quickstart = load_run_config(config.parent / "quickstart.yaml")
    assert (cfg.env, cfg.model, cfg.objective, cfg.sft) == (
        quickstart.env,
        quickstart.model,
        quickstart.objective,
        quickstart.sft,
    )
    assert server.config.num_hidden_layers == model_cfg.num_layers == 2
    assert server.config.moe_layers == (0, 1) and server.config.topk == 2
    assert server.config.eos_token_ids == (259,)  # <|im_end|>: SGLang stops at the checkpoint's eos
    assert server.weight_version == "0"
