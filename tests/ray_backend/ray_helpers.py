"""Run configs of the Ray tests: the quickstart workload shrunk to seconds, and the lab synthesis env."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 4, "moe_router_topk": 2, "max_sequence_length": 256}  # fmt: skip

LAB_TOKEN = "tok-ray-5d21c0"  # the loopback mock lab's bearer token, in every actor's environment

#: every actor asks for a sliver of a CPU: the test cluster has 2 and runs all of them
SMALL_ACTORS = {
    "learner_cpus": 0.1,
    "cpus_per_sampler": 0.1,
    "cpus_per_env_worker": 0.1,
    "placement_timeout_s": 120,
}


def quickstart_tiny(run_dir: Path, *, backend: str = "inprocess", **pipeline: Any) -> dict[str, Any]:
    """configs/quickstart.yaml's env, objective and options; a tiny model and a few short steps."""
    return {
        "env": {"id": "xrd/phase-id-v0", "options": {"tier": 1, "n_peaks": 6, "n_candidates": 4, "phase_pool": 8,
                                                     "answer_format": "formula", "offload": False}},
        "model": {"preset": "tiny-moe", "overrides": TINY},
        "sampler": {"max_new_tokens": 6, "local": {"max_batch_size": 16}},
        "learner": {"optimizer": {"lr": 1e-3}, "micro_batch_size": 8, "router_replay": True, "reference": "initial"},
        "objective": {"loss": "cispo", "advantages": "grpo", "corrections": ["m2po"], "kl_coef": 0.05},
        "pipeline": {"mode": "sync", "batch_groups": 2, "group_size": 4, "total_steps": 2, "eval_every": 0,
                     "dynamic_sampling": False, "progress": False, "max_concurrent_episodes": 16} | pipeline,
        "seed": 0,
        "run_dir": str(run_dir),
        "backend": backend,
        "ray": {"env_workers": 1, "samplers": 1} | SMALL_ACTORS,
    }  # fmt: skip


def lab_synthesis(run_dir: Path, *, latency_s: float, steps: int, ray: dict[str, Any]) -> dict[str, Any]:
    """lab/synthesis-v0 against the in-process mock lab (in the gateway actor), tiny model, pipeline mode."""
    return {
        "env": {"id": "lab/synthesis-v0", "options": {"mock_latency_s": latency_s, "run_id": "raytest"}},
        "model": {"preset": "tiny-moe", "overrides": TINY | {"max_sequence_length": 1024}},
        "sampler": {"max_new_tokens": 4, "local": {"max_batch_size": 16}},
        "learner": {"optimizer": {"lr": 1e-3}, "micro_batch_size": 8},
        "objective": {"loss": "cispo"},
        "pipeline": {"mode": "pipeline", "batch_groups": 2, "group_size": 2, "max_staleness": 2, "total_steps": steps,
                     "eval_every": 0, "dynamic_sampling": False, "progress": False, "max_concurrent_episodes": 8},
        "seed": 0,
        "run_dir": str(run_dir),
        "backend": "ray",
        "ray": SMALL_ACTORS | ray,
    }  # fmt: skip


def trained_groups(run_dir: Path) -> list[list[int]]:
    return [json.loads(x)["groups"] for x in (run_dir / "trained.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
