"""Export megatron-core MoE weights as a Hugging Face checkpoint SGLang and transformers load.

Two target layouts, chosen from the model config:

- ``qwen3_moe`` (Qwen3MoeForCausalLM) when ``qk_layernorm=True``: Qwen3
  applies an RMSNorm to every query and key head, exactly megatron-core's
  ``q_layernorm``/``k_layernorm``; dense layers (``moe_layer_freq > 1``) map
  to ``mlp_only_layers``.
- ``mixtral`` (MixtralForCausalLM) when ``qk_layernorm=False`` and every
  layer is MoE (the ``tiny-moe`` preset): Mixtral has no QK-norm.

Both compute what megatron-core computes with our ``MoEModelConfig``:
RoPE (non-interleaved, rotate-half), RMSNorm (eps 1e-5), SwiGLU experts,
no biases, and top-k routing as softmax over the top-k logits, which equals
softmax over all experts followed by top-k and renormalisation (Mixtral;
Qwen3 with ``norm_topk_prob=True``).

Name and layout mapping (per layer ``i``, expert ``e``)::

    embedding.word_embeddings.weight                  model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight           model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight q_proj / k_proj / v_proj (split, see below)
    decoder.layers.i.self_attention.linear_proj       o_proj
    decoder.layers.i.self_attention.{q,k}_layernorm   self_attn.{q,k}_norm            (qwen3_moe)
    decoder.layers.i.pre_mlp_layernorm.weight         post_attention_layernorm.weight
    decoder.layers.i.mlp.router.weight                mlp.gate | block_sparse_moe.gate
    ...local_experts.e.linear_fc1.weight  (2F, H)     gate_proj|w1 = rows [:F], up_proj|w3 = rows [F:]
    ...local_experts.e.linear_fc2.weight  (H, F)      down_proj|w2
    decoder.final_layernorm.weight                    model.norm.weight
    output_layer.weight                               lm_head.weight

``linear_qkv`` rows are grouped per query group ``g``:
``[q heads of g (heads/groups x d), k_g (d), v_g (d)]``; HF keeps q, k, v
as separate matrices ordered by head. TransformerEngine names
(``linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``,
grouped-GEMM ``experts.linear_fc1.weight{e}``) are normalised first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch

from labrl.errors import ConfigError
from labrl.harness.models.config import PRESETS, MoEModelConfig

Arch = Literal["qwen3_moe", "mixtral"]
RMS_NORM_EPS = 1e-5  # megatron-core TransformerConfig.layernorm_epsilon default

# tiny-moe with QK-norm: the CPU-sized model in the Qwen3-MoE layout (SGLang's
# best-supported MoE family for routed-expert capture and RL weight sync).
TINY_MOE_QWEN3 = PRESETS["tiny-moe"].model_copy(update={"name": "tiny-moe-qwen3", "qk_layernorm": True})


def choose_arch(cfg: MoEModelConfig, arch: Arch | None = None) -> Arch:
    dense = len(cfg.moe_layer_indices) != cfg.num_layers
    if arch is None:
        arch = "qwen3_moe" if cfg.qk_layernorm or dense else "mixtral"
    if arch == "qwen3_moe" and not cfg.qk_layernorm:
        raise ConfigError(
            f"model {cfg.name!r}: Qwen3-MoE always normalises query/key heads: set qk_layernorm=True "
            "(e.g. preset tiny-moe-qwen3) or export as mixtral"
        )
    if arch == "mixtral" and (cfg.qk_layernorm or dense):
        raise ConfigError(
            f"model {cfg.name!r}: Mixtral has no QK-norm and no dense layers: export as qwen3_moe "
            "(set qk_layernorm=True)"
        )
    if cfg.tie_embeddings and arch == "mixtral":
        raise ConfigError(f"model {cfg.name!r}: tied embeddings are not exported as mixtral; use qwen3_moe")
    return arch


def head_dim(cfg: MoEModelConfig) -> int:
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def hf_config(
    cfg: MoEModelConfig,
    arch: Arch | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    torch_dtype: str = "float32",
) -> dict:
    """``config.json`` contents for ``cfg`` in the chosen layout."""
    arch = choose_arch(cfg, arch)
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups or cfg.num_attention_heads,
        "head_dim": head_dim(cfg),
        "max_position_embeddings": cfg.max_sequence_length,
        "rope_theta": float(cfg.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        "rms_norm_eps": RMS_NORM_EPS,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "num_experts_per_tok": cfg.moe_router_topk,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if arch == "mixtral":
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": cfg.num_experts,
            "intermediate_size": cfg.moe_ffn_hidden_size,
            "sliding_window": None,
        }
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layer_indices]
    return {
        **common,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": True,
        "use_sliding_window": False,
        "sliding_window": None,
    }


_TE_RENAMES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
)
_GROUPED = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def normalise_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core names from either layer spec -> the local-spec names; drops ``_extra_state``."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        name = name.removeprefix("module.")
        m = re.match(r"(decoder\.layers\.\d+\.)(.*)$", name)
        if m:
            prefix, rest = m.groups()
            for pattern, local in _TE_RENAMES:
                if pattern.search(rest):
                    rest = local
            g = _GROUPED.search(rest)
            if g:
                rest = f"mlp.experts.local_experts.{g.group(2)}.{g.group(1)}.weight"
            name = prefix + rest
        out[name] = value
    return out


def split_qkv(qkv: torch.Tensor, cfg: MoEModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(groups * (q_per_group + 2) * d, H)`` -> q ``(heads*d, H)``, k, v ``(groups*d, H)``."""
    d = head_dim(cfg)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    q_per = cfg.num_attention_heads // groups
    w = qkv.reshape(groups, q_per + 2, d, -1)  # (G, q_per + 2, d, H)
    q = w[:, :q_per].reshape(groups * q_per * d, -1)
    k = w[:, q_per].reshape(groups * d, -1)
    v = w[:, q_per + 1].reshape(groups * d, -1)
    return q, k, v


def megatron_to_hf(
    state: Mapping[str, torch.Tensor], cfg: MoEModelConfig, arch: Arch | None = None
) -> dict[str, torch.Tensor]:
    """megatron-core state dict -> HF tensors (hub layout, one matrix per expert)."""
    arch = choose_arch(cfg, arch)
    src = normalise_names(state)
    ffn = cfg.moe_ffn_hidden_size
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return src.pop(name).detach().contiguous()
        except KeyError:
            raise ConfigError(
                f"weight {name!r} missing from the megatron state dict (model {cfg.name!r})"
            ) from None

    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if cfg.tie_embeddings:
        src.pop("output_layer.weight", None)
    else:
        out["lm_head.weight"] = take("output_layer.weight")
    for i in range(cfg.num_layers):
        mp, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[hp + "input_layernorm.weight"] = take(mp + "input_layernorm.weight")
        out[hp + "post_attention_layernorm.weight"] = take(mp + "pre_mlp_layernorm.weight")
        q, k, v = split_qkv(take(mp + "self_attention.linear_qkv.weight"), cfg)
        out[hp + "self_attn.q_proj.weight"] = q.contiguous()
        out[hp + "self_attn.k_proj.weight"] = k.contiguous()
        out[hp + "self_attn.v_proj.weight"] = v.contiguous()
        out[hp + "self_attn.o_proj.weight"] = take(mp + "self_attention.linear_proj.weight")
        if cfg.qk_layernorm:
            out[hp + "self_attn.q_norm.weight"] = take(mp + "self_attention.q_layernorm.weight")
            out[hp + "self_attn.k_norm.weight"] = take(mp + "self_attention.k_layernorm.weight")
        if i not in cfg.moe_layer_indices:
            fc1 = take(mp + "mlp.linear_fc1.weight")
            dense_ffn = fc1.shape[0] // 2
            out[hp + "mlp.gate_proj.weight"] = fc1[:dense_ffn].contiguous()
            out[hp + "mlp.up_proj.weight"] = fc1[dense_ffn:].contiguous()
            out[hp + "mlp.down_proj.weight"] = take(mp + "mlp.linear_fc2.weight")
            continue
        moe = hp + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        out[moe + "gate.weight"] = take(mp + "mlp.router.weight")
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(cfg.num_experts):
            ep = f"{mp}mlp.experts.local_experts.{e}."
            fc1 = take(ep + "linear_fc1.weight")  # (2F, H): gate rows then up rows
            out[f"{moe}experts.{e}.{names[0]}.weight"] = fc1[:ffn].contiguous()
            out[f"{moe}experts.{e}.{names[1]}.weight"] = fc1[ffn:].contiguous()
            out[f"{moe}experts.{e}.{names[2]}.weight"] = take(ep + "linear_fc2.weight")
    leftover = sorted(k for k in src if not k.endswith("expert_bias"))
    if leftover:
        raise ConfigError(f"megatron weights with no HF counterpart (model {cfg.name!r}): {leftover[:5]}")
    return out


def training_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype the learner holds its floating-point weights in (bf16 on GPU runs, fp32 on CPU)."""
    dtypes = {v.dtype for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if len(dtypes) == 1:
        return dtypes.pop()
    # mixed (e.g. fp32 router in a bf16 model): serve in the widest half precision present, else fp32
    return torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32


def hf_weights(
    state: Mapping[str, torch.Tensor],
    cfg: MoEModelConfig,
    *,
    arch: Arch | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """What a server loads: ``megatron_to_hf`` in ``dtype`` (default: the training dtype), on CPU.

    The one conversion used by both the disk export (``export_hf_checkpoint``)
    and the distributed update (``SGLangSampler`` with transport
    ``distributed``), so both transports move identical tensors.
    """
    dtype = training_dtype(state) if dtype is None else dtype
    return {k: v.to(dtype).contiguous() for k, v in megatron_to_hf(state, cfg, arch).items()}


def write_tokenizer_files(path: Path) -> None:
    """tokenizer.json (+ config) for labrl's ByteTokenizer: bytes 0-255 as ids 0-255, specials 256-263.

    A byte-level BPE with no merges: every byte is one token and its id is
    the byte value, so ``AutoTokenizer`` (SGLang, transformers) and
    ``ByteTokenizer`` agree on every id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from labrl.harness.tokenizer import SPECIAL_TOKENS

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes, GPT-2 style
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": chat_template(),
                "model_max_length": 1 << 20,
                "pad_token": "<|pad|>",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )


def chat_template() -> str:
    """ByteTokenizer's ChatML as a Jinja chat template (transformers' ``apply_chat_template``).

    Renders exactly what ``ByteTokenizer.chat_prompt`` tokenises: each message
    as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, the tool block of
    ``labrl.harness.tokenizer.tools_system_text`` appended to the system
    message (an empty one is added when tools come without it), each tool's
    JSON with sorted keys and ASCII escapes like ``json.dumps``.
    """
    from labrl.harness.tokenizer import tools_system_text

    # the block around the tool lines, taken from the byte tokenizer's own text
    head, tail = tools_system_text([]).split("\n</tools>", 1)
    tail = "\n</tools>" + tail

    def lit(text: str) -> str:
        return json.dumps(text)  # a JSON string is a valid Jinja string literal

    tools_block = (
        "{%- macro tools_text() -%}{{ " + lit(head) + " }}"
        "{%- for t in tools -%}{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
        "{{ (t.function if t.function is defined else t) | tojson(ensure_ascii=True, sort_keys=True) }}"
        "{%- endfor -%}{{ " + lit(tail) + " }}{%- endmacro -%}"
    )
    return (
        tools_block + "{%- if tools and (messages | length == 0 or messages[0].role != 'system') -%}"
        "{{ '<|im_start|>system\\n' + tools_text() + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- for m in messages -%}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
        "{%- if m.role == 'system' and tools -%}{{ tools_text() }}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (ByteLevel's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def export_hf_checkpoint(
    state: Mapping[str, torch.Tensor],
    cfg: MoEModelConfig,
    path: str | Path,
    *,
    arch: Arch | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: bool = True,
    eos_token_id: int | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) into ``path``.

    ``dtype=None`` writes the training dtype (``training_dtype``): a bf16
    learner's checkpoint is bf16, and ``config.json``'s ``torch_dtype`` says so,
    so a server launched with ``--dtype auto`` serves what was trained.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.cpu() for k, v in hf_weights(state, cfg, arch=arch, dtype=dtype).items()}
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    if tokenizer and eos_token_id is None and cfg.vocab_size == 264:
        from labrl.harness.tokenizer import SPECIAL_TOKENS

        eos_token_id = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    config = hf_config(cfg, arch, eos_token_id=eos_token_id, torch_dtype=dtype_name)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_token_id, "do_sample": True})
    )
    if tokenizer:
        write_tokenizer_files(path)
    return path
