"""Import a Hugging Face MoE checkpoint (Qwen3-MoE or Mixtral layout) into megatron-core weights.

The inverse of ``labrl.harness.models.hf_export`` (see its docstring for the name
mapping): ``config_from_hf`` reads ``config.json`` into a ``MoEModelConfig``
and ``hf_to_megatron`` rebuilds the local-spec state dict, so training can
start from any such checkpoint on disk::

    cfg = config_from_hf(path)
    model = build_gpt_model(cfg)
    load_into_model(model, load_hf_checkpoint(path, cfg))
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from labrl.errors import ConfigError
from labrl.harness.models.config import MoEModelConfig
from labrl.harness.models.hf_export import RMS_NORM_EPS, Arch, head_dim


def _arch(config: Mapping) -> Arch:
    kind = config.get("model_type")
    if kind in ("qwen3_moe", "mixtral"):
        return kind
    raise ConfigError(
        f"config.json model_type {kind!r} is not supported: use a qwen3_moe or mixtral checkpoint"
    )


def config_from_hf(path: str | Path, name: str | None = None) -> MoEModelConfig:
    """``MoEModelConfig`` equivalent to the checkpoint's ``config.json``; refuses what it cannot express."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    arch = _arch(config)
    eps = float(config.get("rms_norm_eps", RMS_NORM_EPS))
    if abs(eps - RMS_NORM_EPS) > 1e-12:
        raise ConfigError(
            f"{path}: rms_norm_eps={eps} differs from megatron-core's 1e-5 used by MoEModelConfig"
        )
    if config.get("attention_bias"):
        raise ConfigError(f"{path}: attention_bias=true is not supported (MoEModelConfig has no biases)")
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000))
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ConfigError(f"{path}: RoPE scaling {rope or config.get('rope_scaling')} is not supported")
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hd = config.get("head_dim") or hidden // heads
    if arch == "mixtral":
        experts, ffn, moe_ffn, freq, qk = (
            config["num_local_experts"],
            config["intermediate_size"],
            None,
            1,
            False,
        )
        moe_ffn = ffn
    else:
        if not config.get("norm_topk_prob", False):
            raise ConfigError(
                f"{path}: norm_topk_prob=false is not expressible (megatron softmaxes the top-k)"
            )
        dense = sorted(config.get("mlp_only_layers") or [])
        step = int(config.get("decoder_sparse_step", 1))
        moe_idx = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        freq = _layer_freq(moe_idx, layers, path)
        experts, ffn, moe_ffn, qk = (
            config["num_experts"],
            config.get("intermediate_size", config["moe_intermediate_size"]),
            config["moe_intermediate_size"],
            True,
        )
    return MoEModelConfig(
        name=name or path.name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=None if kv_heads == heads else kv_heads,
        kv_channels=None if hd == hidden // heads else int(hd),
        ffn_hidden_size=int(ffn),
        num_experts=int(experts),
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(moe_ffn),
        moe_layer_freq=freq,
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        qk_layernorm=qk,
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings", 4096)),
        rotary_base=int(theta),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _layer_freq(moe_idx: list[int], layers: int, path: Path) -> int:
    # MoEModelConfig places MoE layers at i % freq == 0; find the freq that reproduces the checkpoint's.
    for freq in range(1, layers + 1):
        if [i for i in range(layers) if i % freq == 0] == moe_idx:
            return freq
    raise ConfigError(f"{path}: MoE layers {moe_idx} are not every n-th layer from 0; not expressible")


def load_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], cfg: MoEModelConfig, arch: Arch, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """HF tensors (hub layout) -> megatron-core local-spec state dict."""
    src = dict(hf)
    d = head_dim(cfg)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    q_per = cfg.num_attention_heads // groups

    def take(name: str) -> torch.Tensor:
        try:
            return src.pop(name).to(dtype)
        except KeyError:
            raise ConfigError(
                f"HF checkpoint lacks {name!r} (expected by a {arch} model {cfg.name!r})"
            ) from None

    out = {
        "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
    }
    out["output_layer.weight"] = (
        out["embedding.word_embeddings.weight"]
        if cfg.tie_embeddings and "lm_head.weight" not in src
        else take("lm_head.weight")
    )
    for i in range(cfg.num_layers):
        mp, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[mp + "input_layernorm.weight"] = take(hp + "input_layernorm.weight")
        out[mp + "pre_mlp_layernorm.weight"] = take(hp + "post_attention_layernorm.weight")
        q = take(hp + "self_attn.q_proj.weight").reshape(groups, q_per, d, -1)
        k = take(hp + "self_attn.k_proj.weight").reshape(groups, 1, d, -1)
        v = take(hp + "self_attn.v_proj.weight").reshape(groups, 1, d, -1)
        out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(
            -1, cfg.hidden_size
        )
        out[mp + "self_attention.linear_proj.weight"] = take(hp + "self_attn.o_proj.weight")
        if cfg.qk_layernorm:
            out[mp + "self_attention.q_layernorm.weight"] = take(hp + "self_attn.q_norm.weight")
            out[mp + "self_attention.k_layernorm.weight"] = take(hp + "self_attn.k_norm.weight")
        if i not in cfg.moe_layer_indices:
            gate, up = take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")
            out[mp + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[mp + "mlp.linear_fc2.weight"] = take(hp + "mlp.down_proj.weight")
            continue
        moe = hp + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        out[mp + "mlp.router.weight"] = take(moe + "gate.weight")
        for e in range(cfg.num_experts):
            ep = f"{mp}mlp.experts.local_experts.{e}."
            gate = take(f"{moe}experts.{e}.{names[0]}.weight")
            up = take(f"{moe}experts.{e}.{names[1]}.weight")
            out[ep + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[ep + "linear_fc2.weight"] = take(f"{moe}experts.{e}.{names[2]}.weight")
    src.pop("lm_head.weight", None)
    if src:
        raise ConfigError(f"HF tensors with no megatron counterpart: {sorted(src)[:5]}")
    return out


def load_hf_checkpoint(path: str | Path, cfg: MoEModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Read a checkpoint dir into a megatron-core state dict (for ``model.load_state_dict(strict=False)``)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    cfg = cfg or config_from_hf(path)
    return hf_to_megatron(load_hf_tensors(path), cfg, _arch(config))


def load_into_model(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into a megatron-core model; every parameter must be covered."""
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
