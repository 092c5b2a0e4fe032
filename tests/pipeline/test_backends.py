"""The assembly of a run: both backends satisfy ``Backend``, the warm start honours ``should_stop``,
and ``summary.json`` has one writer."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
from pathlib import Path

import pytest

from labrl.harness.backends import parts
from labrl.harness.backends.base import Backend, RunParts, RunStart
from labrl.harness.backends.inprocess import InProcessBackend
from labrl.harness.backends.ray.backend import RayBackend
from labrl.harness.config import build_run_config
from labrl.harness.pipeline.orchestrator import PipelineStalledError
from labrl.harness.pipeline.runner import select_backend, train

ROOT = Path(__file__).resolve().parents[2]
TINY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 32, "num_experts": 2, "moe_router_topk": 2, "max_sequence_length": 32}  # fmt: skip


def config(env_id: str, run_dir: Path, *, sft_steps: int = 0, env_options: dict | None = None, **pipeline):
    return build_run_config(
        {
            "env": {"id": env_id, "options": env_options or {}},
            "model": {"preset": "tiny-moe", "overrides": TINY},
            "sampler": {"max_new_tokens": 2, "local": {"max_batch_size": 16}},
            "learner": {"micro_batch_size": 8, "router_replay": False},
            "pipeline": {"batch_groups": 2, "group_size": 2, "total_steps": 2, "eval_every": 0,
                         "progress": False, "dynamic_sampling": False, "checkpoint_every_s": 0} | pipeline,
            "objective": {"advantages": "whiten"},
            "sft": {"enabled": sft_steps > 0, "steps": max(sft_steps, 1), "batch_size": 2, "num_prompts": 4},
            "run_dir": str(run_dir),
        }
    )  # fmt: skip


@pytest.mark.parametrize("backend", [InProcessBackend, RayBackend])
def test_each_backend_implements_the_protocol(backend):
    assert isinstance(backend(), Backend)
    assert inspect.signature(backend.start) == inspect.signature(Backend.start)
    assert inspect.get_annotations(backend.start)["return"] == "RunParts"


def test_the_runner_picks_the_backend_the_config_names():
    assert type(select_backend("inprocess")) is InProcessBackend
    assert type(select_backend("ray")) is RayBackend


async def test_the_shared_warm_start_stops_when_asked(letter_env, tmp_path):
    cfg = config(letter_env, tmp_path, sft_steps=5)
    learner = parts.build_learner(cfg)
    seen: list[dict] = []
    sft_s = await parts.warm_start(
        learner, cfg, parts.build_tokenizer(cfg), parts.make_env_factory(cfg),
        on_sft=seen.append, should_stop=lambda: len(seen) >= 2,
    )  # fmt: skip
    assert [r["sft_step"] for r in seen] == [1, 2]
    assert sft_s > 0


async def test_inprocess_backend_warm_starts_a_fresh_run_only(letter_env, tmp_path):
    cfg = config(letter_env, tmp_path, sft_steps=3)
    tokenizer, make_env = parts.build_tokenizer(cfg), parts.make_env_factory(cfg)
    seen: list[dict] = []
    run_parts = await InProcessBackend().start(
        RunStart(cfg, tokenizer, make_env, on_sft=seen.append, should_stop=lambda: len(seen) >= 1)
    )
    assert isinstance(run_parts, RunParts) and [r["sft_step"] for r in seen] == [1]
    assert run_parts.sampler.version == run_parts.learner.version == 0
    assert await run_parts.close() == {}
    seen.clear()
    resumed = await InProcessBackend().start(
        RunStart(cfg, tokenizer, make_env, resume=True, on_sft=seen.append)
    )
    assert seen == [] and resumed.sft_s == 0.0


def _calls(name: str) -> list[str]:
    """``path:function`` of every call of ``name`` in the package's source."""
    found = []
    for folder in ("harness", "labrl", "envs", "lab_adapters", "verifiers"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(fn):
                        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
                            found.append(f"{path.relative_to(ROOT)}:{fn.name}")
    return sorted(set(found))


def test_summary_json_has_one_writer():
    assert _calls("write_summary") == ["harness/pipeline/runner.py:_train"]


@pytest.mark.parametrize("dynamic_sampling", [True, False])
async def test_a_stalled_run_writes_the_orchestrators_summary_through_train(
    letter_env, tmp_path, dynamic_sampling
):
    run = tmp_path / "run"
    # every episode raises EnvError: no group is trainable, so the run stalls at step 0 with dynamic
    # sampling on or off (off, it used to drop untrainable groups forever)
    cfg = config(letter_env, run, env_options={"error_every": 1}, dynamic_sampling=dynamic_sampling,
                 max_oversample_factor=1.0)  # fmt: skip
    with pytest.raises(PipelineStalledError) as info:
        await asyncio.wait_for(train(cfg), timeout=300)
    summary = json.loads((run / "summary.json").read_text())
    stalled = json.loads(json.dumps(info.value.summary, default=str))
    assert {k: summary[k] for k in stalled} == stalled  # every key the orchestrator reported, unchanged
    assert summary["stalled"] is True and summary["error"] == str(info.value)
    assert "failed episodes: env_error: EnvError: letter backend down for task" in summary["error"]
    assert summary["checkpoint"] == str(run / "checkpoints" / "step_000000")
    assert summary["backend"] == "inprocess" and summary["stopped_by"] is None
