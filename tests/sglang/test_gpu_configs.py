"""The GPU recipes parse into the typed configs they feed (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from labrl.harness.hf_export import TINY_MOE_QWEN3
from labrl.harness.models.config import ParallelConfig, get_preset
from labrl.harness.samplers.sglang import SGLangSamplerConfig

RECIPES = sorted((Path(__file__).parents[2] / "configs" / "gpu").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates(path):
    recipe = yaml.safe_load(path.read_text())
    sampler = SGLangSamplerConfig(**recipe["sampler"]["sglang"])
    ParallelConfig(**recipe["parallel"])
    preset = recipe["model"]["preset"]
    model = TINY_MOE_QWEN3 if preset == "tiny-moe-qwen3" else get_preset(preset)
    assert sampler.num_hidden_layers == model.num_layers
    assert list(sampler.moe_layers) == model.moe_layer_indices
    assert sampler.topk == model.moe_router_topk


def test_there_are_recipes():
    assert len(RECIPES) >= 2
