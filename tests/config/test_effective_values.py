"""Effective values: every ``auto`` and mode-derived key resolved once, and resume identity in one place.

- ``effective_values`` applies the components' own rules (``models.device``,
  ``PipelineSection.effective_max_staleness``) for the machine it is given;
- ``effective.json`` round-trips, keyed by the config keys it resolves;
- resume compares the dtype the previous run recorded with the one this run
  resolves, so a changed ``auto`` is refused instead of followed;
- the identity keys are the marked fields plus ``derived_identity``, and
  docs/runs.md lists each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labrl.errors import ConfigError
from labrl.harness.config import RunConfig, apply_overrides, build_run_config, component_configs
from labrl.harness.effective import EFFECTIVE_FILE, effective_values, read_effective, write_effective
from labrl.harness.identity import identity_fields
from labrl.harness.models.device import Capabilities
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.pipeline.resume import (
    DERIVED_IDENTITY,
    IDENTITY_KEYS,
    check_resume,
    derived_identity,
    run_identity,
)
from labrl.harness.samplers.sglang.sampler import MODEL_SHAPE_FIELDS, served_model_shape
from labrl.harness.tokenizer import ByteTokenizer

ROOT = Path(__file__).parents[2]
CPU = Capabilities(cuda=False, transformer_engine=False)
CUDA = Capabilities(cuda=True, transformer_engine=True, cuda_index=1)
BASE = {"env": {"id": "test/letter-v0"}}
SGLANG = [
    "sampler.kind=sglang",
    "sampler.sglang.urls=[http://127.0.0.1:1]",
    "sampler.sglang.export_dir=/tmp/x",
]


# a model over BF16_MIN_PARAMETERS (only its config is built): auto picks bf16 on CUDA for it
BIG = "model.preset=qwen3-30b-a3b"


def config(*overrides: str) -> RunConfig:
    return build_run_config(apply_overrides(BASE, list(overrides)))


@pytest.mark.parametrize(("mode", "bound"), [("sync", 0), ("one_step_off", 1), ("pipeline", 6)])
def test_the_staleness_bound_of_each_mode(mode, bound):
    cfg = config(f"pipeline.mode={mode}", "pipeline.max_staleness=6")
    assert cfg.pipeline.max_staleness == 6  # config.yaml keeps what was written
    assert cfg.pipeline.effective_max_staleness == bound
    assert effective_values(cfg, CPU).max_staleness == bound


def test_auto_device_and_precision_follow_the_machine():
    cfg = config()
    assert effective_values(cfg, CPU).as_config_keys() == {
        "pipeline.max_staleness": 4,
        "learner.device": "cpu",
        "learner.precision": "fp32",
        "sampler.local.device": "cpu",
        "sampler.local.precision": "fp32",
    }
    small_on_gpu = effective_values(cfg, CUDA)  # 0.6M parameters: fp32 even on CUDA
    assert (small_on_gpu.learner_device, small_on_gpu.learner_precision) == ("cuda:1", "fp32")
    assert (small_on_gpu.sampler_device, small_on_gpu.sampler_precision) == ("cuda:1", "fp32")
    on_gpu = effective_values(config(BIG), CUDA)
    assert (on_gpu.learner_device, on_gpu.learner_precision) == ("cuda:1", "bf16")
    assert (on_gpu.sampler_device, on_gpu.sampler_precision) == ("cuda:1", "bf16")
    explicit = effective_values(config("learner.precision=fp32", "sampler.local.device=cpu"), CUDA)
    assert (explicit.learner_precision, explicit.sampler_device, explicit.sampler_precision) == (
        "fp32",
        "cpu",
        "fp32",
    )


def test_a_device_that_is_not_there_is_a_config_error():
    with pytest.raises(ConfigError, match=re.escape("device='cuda' but CUDA is not available here")):
        effective_values(config("learner.device=cuda"), CPU)


def test_the_sglang_export_dtype_auto_is_the_learners_dtype():
    assert effective_values(config(*SGLANG, BIG), CUDA).as_config_keys() == {
        "pipeline.max_staleness": 4,
        "learner.device": "cuda:1",
        "learner.precision": "bf16",
        "sampler.sglang.export_dtype": "bfloat16",
    }
    assert effective_values(config(*SGLANG), CPU).export_dtype == "float32"
    assert effective_values(config(*SGLANG), CUDA).export_dtype == "float32"  # a small model: fp32
    assert (
        effective_values(config(*SGLANG, "sampler.sglang.export_dtype=float16"), CUDA).export_dtype
        == "float16"
    )


def test_ray_actors_resolve_auto_for_the_gpus_they_were_given():
    no_gpus = effective_values(config("backend=ray"), CUDA)  # Ray hides the machine's GPUs from them
    assert (no_gpus.learner_device, no_gpus.learner_precision, no_gpus.sampler_device) == (
        "cpu",
        "fp32",
        "cpu",
    )
    given = effective_values(
        config("backend=ray", "ray.learner_gpus=1", "ray.gpus_per_sampler=0.5", BIG), CPU
    )
    assert (given.learner_device, given.learner_precision) == ("cuda:0", "bf16")
    assert (given.sampler_device, given.sampler_precision) == ("cuda:0", "bf16")


def test_effective_json_round_trips_and_a_bad_one_is_named(tmp_path):
    assert read_effective(tmp_path) is None
    values = effective_values(config("pipeline.mode=sync"), CUDA)
    path = write_effective(tmp_path, values)
    assert path == tmp_path / EFFECTIVE_FILE
    assert json.loads(path.read_text())["pipeline.max_staleness"] == 0
    assert read_effective(tmp_path) == values
    path.write_text('{"learner.precision": "fp16"}')
    with pytest.raises(
        ConfigError, match=re.escape(f"{path} (the resolved values of the run being resumed)")
    ):
        read_effective(tmp_path)


def test_effective_values_stay_out_of_the_config_dump():
    dumped = config().model_dump(mode="json")
    assert dumped["learner"]["precision"] == "auto" and dumped["pipeline"]["max_staleness"] == 4
    assert "effective_max_staleness" not in dumped["pipeline"]


# -- resume identity ---------------------------------------------------------------


def test_a_resume_whose_auto_now_resolves_to_another_dtype_is_refused():
    """The checkpoint was trained in bf16 (auto on CUDA); the same config on CPU resolves fp32."""
    cfg = config(BIG)
    trained_in = effective_values(cfg, CUDA)
    with pytest.raises(ConfigError) as err:
        check_resume(cfg, cfg, recorded=trained_in, effective=effective_values(cfg, CPU))
    message = str(err.value)
    assert 'different learner.precision (learner.precision: "bf16" -> "fp32")' in message
    assert "set it to the checkpoint's explicitly" in message
    assert check_resume(cfg, cfg, recorded=trained_in, effective=effective_values(cfg, CUDA)) == {}


def test_a_written_precision_that_resolves_to_the_recorded_dtype_is_no_change():
    before, after = config(), config("learner.precision=fp32", "learner.device=cpu")
    changes = check_resume(
        before, after, recorded=effective_values(before, CPU), effective=effective_values(after, CPU)
    )
    assert changes == {"learner.device": ("auto", "cpu")}  # the device is tunable, the dtype is identity


def test_the_identity_keys_are_the_marked_fields_and_the_derived_keys():
    assert set(IDENTITY_KEYS) == {
        "env.id",
        "env.options",
        "model.shape",
        "model.init_from_hf",
        "tokenizer",
        "objective.loss",
        "learner.reference",
        "learner.precision",
        "parallel",
        "seed",
        "pipeline.group_size",
    }
    cfg = config()
    effective = effective_values(cfg, CPU)
    assert set(derived_identity(cfg, effective)) == set(DERIVED_IDENTITY)
    assert set(identity_fields(RunConfig)) | set(DERIVED_IDENTITY) == set(IDENTITY_KEYS)
    identity = run_identity(cfg, effective)
    assert identity["parallel"] == {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1}
    assert (identity["learner.precision"], identity["tokenizer"], identity["pipeline.group_size"]) == (
        "fp32",
        "bytes",
        8,
    )
    assert identity_fields(PipelineSection, "pipeline.") == ("pipeline.group_size",)


def test_docs_list_every_identity_key():
    doc = (ROOT / "docs" / "runs.md").read_text()
    assert [key for key in IDENTITY_KEYS if f"| `{key}` |" not in doc] == []


# -- the SGLang model shape ----------------------------------------------------------


def test_the_sglang_model_shape_comes_from_one_function():
    cfg = config(*SGLANG, "model.overrides.num_layers=3", "model.overrides.moe_layer_freq=2")
    model = cfg.model.resolve()
    shape = served_model_shape(model)
    assert tuple(shape) == MODEL_SHAPE_FIELDS and shape == {
        "num_hidden_layers": 3,
        "moe_layers": (0, 2),
        "topk": 2,
    }
    sampler = component_configs(cfg, model=model, pad_token_id=ByteTokenizer().pad_token_id).sampler
    assert sampler == sampler.with_model(model)
