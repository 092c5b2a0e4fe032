"""Shared by the weight-sync tests: tiny models, transformers' checkpoint layout, learner log-probs."""

from __future__ import annotations

import glob
import tempfile

import torch

from labrl.harness.models.build import build_gpt_model, causal_attention_mask
from labrl.harness.models.config import PRESETS, MoEModelConfig
from labrl.harness.models.hf_export import TINY_MOE_QWEN3, hf_config

SMALL = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "moe_ffn_hidden_size": 48,
    "max_sequence_length": 128,
}
MODELS: dict[str, MoEModelConfig] = {
    "qwen3_moe": TINY_MOE_QWEN3.model_copy(update={**SMALL, "num_query_groups": 2}),
    "mixtral": PRESETS["tiny-moe"].model_copy(update=SMALL),
    # dense layers 1 and 3 between MoE layers 0 and 2 (Qwen3-MoE mlp_only_layers)
    "qwen3_moe_mixed": TINY_MOE_QWEN3.model_copy(update={**SMALL, "num_layers": 4, "moe_layer_freq": 2}),
}


def megatron_state(cfg: MoEModelConfig, seed: int) -> dict[str, torch.Tensor]:
    model = build_gpt_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # decisive routing (no top-k ties) and norms that are not all ones
        for name, p in model.named_parameters():
            if "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def transformers_checkpoint_layout(cfg: MoEModelConfig, dtype: torch.dtype) -> dict[str, tuple]:
    """``{name: (shape, dtype)}`` of the checkpoint transformers writes for the exported class.

    The class (``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM``) is built
    tiny from the exported ``config.json`` on CPU. transformers 5 keeps MoE
    experts fused in memory (``experts.gate_up_proj``) but serialises them in
    the hub layout (one matrix per expert), which is what SGLang's
    ``load_weights`` maps: so the reference is ``save_pretrained``'s output.
    """
    import transformers
    from safetensors.torch import load_file

    c = hf_config(cfg)
    conf = transformers.AutoConfig.for_model(
        c["model_type"], **{k: v for k, v in c.items() if k != "model_type"}
    )
    model = transformers.AutoModelForCausalLM.from_config(conf).to(dtype)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(f"{d}/*.safetensors")):
            tensors.update(load_file(f))
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}


def learner_logprobs(
    cfg: MoEModelConfig, state: dict[str, torch.Tensor], ids: list[int], n_out: int
) -> list[float]:
    """Log-probs the learner's megatron model gives the last ``n_out`` tokens of ``ids``."""
    model = build_gpt_model(cfg, seed=0)
    model.load_state_dict(state, strict=False)
    model.eval()
    x = torch.tensor([ids])
    T = x.shape[1]
    with torch.no_grad():
        logits = model(x, torch.arange(T)[None], causal_attention_mask(T)).float()  # (1, T, V)
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    targets = x[0, 1:]
    picked = logp.gather(1, targets[:, None])[:, 0]
    return picked[-n_out:].tolist()


# -- synthetic TP=2 / EP=2 shards, cut by megatron-core's rules (written out here, independently) --


def shard_tp(name: str, full: torch.Tensor, t: int, tp: int) -> torch.Tensor:
    """megatron-core's tensor-parallel piece ``t`` of one full local-spec weight."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return full.chunk(tp, dim=0)[t].clone()  # vocab / column parallel (qkv rows grouped per query group)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[t].clone()  # row parallel
    if name.endswith("linear_fc1.weight"):  # gated: each rank holds [its gate rows; its up rows]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[t], up.chunk(tp, dim=0)[t]], dim=0).clone()
    return full.clone()  # norms, router: replicated


def model_parallel_shards(state: dict[str, torch.Tensor], tp: int, ep: int, num_experts: int) -> dict:
    local = num_experts // ep
    out: dict = {}
    for t in range(tp):
        for e in range(ep):
            rank: dict[str, torch.Tensor] = {}
            for name, full in state.items():
                if ".local_experts." in name:
                    head, rest = name.split(".local_experts.")
                    idx, tail = rest.split(".", 1)
                    g = int(idx)
                    if g // local != e:
                        continue  # another EP rank's expert
                    name = f"{head}.local_experts.{g % local}.{tail}"
                rank[name] = shard_tp(name, full, t, tp)
            out[(t, e)] = rank
    return out
