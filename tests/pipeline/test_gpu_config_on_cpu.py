"""``configs/gpu/quickstart-h100.yaml`` trains end to end on CPU, shrunk.

The GPU config's path, minus its size: a bf16 learner with fp32 master weights, the static decode
engine with routing capture, router replay, the KL reference to the warm-started policy, M2PO and
the warm start. A GPU session (15 device minutes) then spends none of them on a config that cannot
start. Shrunk: the model, the sizes, and dynamic sampling off (with whitened advantages, so a
2-step warm start's all-wrong groups still train): what is kept is every code path the config
selects.
"""

from __future__ import annotations

import json
from pathlib import Path

from labrl.cli import main
from labrl.harness.samplers import local

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "configs" / "gpu" / "quickstart-h100.yaml"
SHRINK = [
    "model.overrides.num_layers=2", "model.overrides.hidden_size=64", "model.overrides.num_attention_heads=4",
    "model.overrides.ffn_hidden_size=128", "model.overrides.num_experts=4", "model.overrides.moe_router_topk=2",
    "model.overrides.moe_ffn_hidden_size=64",
    "sft.steps=2", "sft.warmup_steps=1", "sft.batch_size=2", "sft.num_prompts=2",
    "pipeline.total_steps=2", "pipeline.eval_every=2", "pipeline.eval_size=4", "pipeline.batch_groups=2",
    "pipeline.group_size=2", "pipeline.max_concurrent_episodes=8", "pipeline.progress=false",
    "pipeline.dynamic_sampling=false", "pipeline.retry_all_wrong=0", "objective.advantages=whiten",
    "sampler.local.max_batch_size=4", "learner.micro_batch_size=2",
]  # fmt: skip


def test_the_h100_config_trains_end_to_end_on_cpu_shrunk(tmp_path, capsys, monkeypatch):
    engines = []
    real = local.StaticDecodeEngine

    def counted(*args, **kwargs):
        engines.append(real(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(local, "StaticDecodeEngine", counted)
    run = tmp_path / "run"
    assert main(["train", str(CONFIG), *SHRINK, f"run_dir={run}"]) == 0, capsys.readouterr()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["samples/trained"] == 4 for r in rows)
    assert all(r["learner/router_replay"] == 1.0 and r["learner/reference"] == 1.0 for r in rows)
    assert all("m2po/masked_frac" in r for r in rows)
    assert engines  # the sampler decoded with the static engine, as the config selects
    effective = json.loads((run / "effective.json").read_text())
    assert effective["learner.precision"] == effective["sampler.local.precision"] == "bf16"
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    # the config's warmup (shrunk to 1 of the 2 steps): half the warm-start lr, then all of it
    sft = [json.loads(x) for x in (run / "sft.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in sft] == [2.5e-4, 5e-4]
