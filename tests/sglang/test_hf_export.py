"""Export megatron-core MoE weights to HF, load them with transformers, match logits; import back."""

from __future__ import annotations

import json
import re

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.models.build import build_gpt_model, causal_attention_mask
from labrl.harness.models.config import PRESETS
from labrl.harness.models.hf_export import TINY_MOE_QWEN3, choose_arch, export_hf_checkpoint, megatron_to_hf
from labrl.harness.models.hf_import import config_from_hf, hf_to_megatron, load_hf_checkpoint, load_into_model

SMALL = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "moe_ffn_hidden_size": 48,
    "max_sequence_length": 64,
}
CASES = {
    "mixtral": PRESETS["tiny-moe"].model_copy(update=SMALL),
    "qwen3_moe": TINY_MOE_QWEN3.model_copy(update=SMALL),
    # grouped-query attention: 4 heads in 2 query groups
    "qwen3_moe_gqa": TINY_MOE_QWEN3.model_copy(update={**SMALL, "num_query_groups": 2}),
    # dense layers 1 and 3 between MoE layers 0 and 2: Qwen3-MoE mlp_only_layers=[1, 3]
    "qwen3_moe_mixed": TINY_MOE_QWEN3.model_copy(update={**SMALL, "num_layers": 4, "moe_layer_freq": 2}),
    # heads of width 24 while hidden/heads = 16 (head_dim in config.json)
    "qwen3_moe_wide_heads": TINY_MOE_QWEN3.model_copy(
        update={**SMALL, "kv_channels": 24, "num_query_groups": 2}
    ),
    "mixtral_wide_heads": PRESETS["tiny-moe"].model_copy(update={**SMALL, "kv_channels": 24}),
}
ARCH = {case: "mixtral" if case.startswith("mixtral") else "qwen3_moe" for case in CASES}


def _randomised(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))  # not all ones: catches swapped norms
            elif "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen))  # decisive routing: no top-k ties
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    T = ids.shape[1]
    pos = torch.arange(T)[None].expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, causal_attention_mask(T)).float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers_with_same_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = CASES[case]
    model = build_gpt_model(cfg, seed=1).eval()
    state = _randomised(model)
    path = export_hf_checkpoint(state, cfg, tmp_path / case)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == ARCH[case]
    assert config["head_dim"] == (24 if case.endswith("wide_heads") else 16)
    if ARCH[case] == "qwen3_moe":
        assert config["mlp_only_layers"] == ([1, 3] if case.endswith("mixed") else [])
    hf, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = hf.eval()(input_ids=ids).logits.float()
    diff = (hf_logits - _megatron_logits(model, ids)).abs().max().item()
    assert diff < 1e-4, f"{case}: max |logit diff| = {diff}"
    # the tokenizer files give the byte tokenizer's ids
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.encode("hé!") == list("hé!".encode())
    assert tok.convert_tokens_to_ids("<|im_end|>") == config["eos_token_id"] == 257 + 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_round_trip(case, tmp_path):
    cfg = CASES[case]
    model = build_gpt_model(cfg, seed=2)
    state = _randomised(model)
    arch = choose_arch(cfg)
    back = hf_to_megatron(megatron_to_hf(state, cfg), cfg, arch)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    path = export_hf_checkpoint(state, cfg, tmp_path / "ckpt", tokenizer=False)
    cfg2 = config_from_hf(path, name=cfg.name)
    # Mixtral has no dense-MLP width: with every layer MoE, ffn_hidden_size is unused and not kept
    same = {"init_method_std": cfg2.init_method_std}
    if arch == "mixtral":
        same["ffn_hidden_size"] = cfg2.ffn_hidden_size
    assert cfg2 == cfg.model_copy(update=same)
    fresh = build_gpt_model(cfg2, seed=7)
    load_into_model(fresh, load_hf_checkpoint(path))
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_megatron_logits(fresh, ids), _megatron_logits(model, ids))


def test_inexpressible_configs_are_refused():
    msg = "model 'tiny-moe': Qwen3-MoE always normalises query/key heads: set qk_layernorm=True"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        choose_arch(PRESETS["tiny-moe"], "qwen3_moe")
    msg = "model 'tiny-moe-qwen3': Mixtral has no QK-norm and no dense layers: export as qwen3_moe"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        choose_arch(TINY_MOE_QWEN3, "mixtral")
    assert choose_arch(PRESETS["tiny-moe"]) == "mixtral" and choose_arch(TINY_MOE_QWEN3) == "qwen3_moe"
