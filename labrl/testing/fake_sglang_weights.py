"""The fake SGLang server's weights, held and loaded the way SGLang's model classes do.

SGLang's ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` keep fused
parameters and load checkpoint (HF) names through ``load_weights``
(``sglang/srt/models/qwen3_moe.py``)::

    q_proj | k_proj | v_proj            -> self_attn.qkv_proj.weight      shards "q", "k", "v"
    gate_proj | up_proj (dense MLP)     -> mlp.gate_up_proj.weight        shards 0, 1
    experts.{e}.gate_proj | up_proj     -> experts.w13_weight[e]          shards "w1", "w3"
      (Mixtral: experts.{e}.w1 | w3)
    experts.{e}.down_proj (Mixtral w2)  -> experts.w2_weight[e]           shard "w2"
    anything else                       -> the parameter of that name

and a name that matches no parameter is skipped without a word
(``if name not in params_dict: continue``). ``SGLangStyleWeights`` does the
same, but counts what it skipped (``skipped``), so a test can assert that an
update changed every weight. A shard whose shape does not fit raises, as
SGLang's weight loaders do. ``hf_state`` splits the fused parameters back
into HF tensors, which the fake hands to its generating backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from labrl.errors import SamplerError
from labrl.harness.models.config import MoEModelConfig
from labrl.harness.models.hf_export import Arch, head_dim


class SGLangStyleWeights:
    """Fused parameters of one served model, loaded by HF name like SGLang's ``load_weights``."""

    def __init__(self, cfg: MoEModelConfig, arch: Arch, hf: Mapping[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.arch = arch
        d = head_dim(cfg)
        groups = cfg.num_query_groups or cfg.num_attention_heads
        self._qkv_rows = {"q": cfg.num_attention_heads * d, "k": groups * d, "v": groups * d}
        self._expert_names = (
            ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )
        self._moe = "block_sparse_moe." if arch == "mixtral" else "mlp."
        self.params: dict[str, torch.Tensor] = {}
        self.skipped: list[str] = []
        self.loaded = 0
        self._allocate(hf)
        self.load_weights(hf.items())
        if self.skipped:
            raise SamplerError(f"the initial checkpoint has names the model lacks: {self.skipped[:5]}")

    # -- layout ------------------------------------------------------------------------------

    def _allocate(self, hf: Mapping[str, torch.Tensor]) -> None:
        cfg = self.cfg
        dtype = next(iter(hf.values())).dtype
        H, F = cfg.hidden_size, cfg.moe_ffn_hidden_size

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype)

        self.params["model.embed_tokens.weight"] = zeros(cfg.vocab_size, H)
        self.params["model.norm.weight"] = zeros(H)
        if not cfg.tie_embeddings:
            self.params["lm_head.weight"] = zeros(cfg.vocab_size, H)
        qkv = sum(self._qkv_rows.values())
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.params[p + "input_layernorm.weight"] = zeros(H)
            self.params[p + "post_attention_layernorm.weight"] = zeros(H)
            self.params[p + "self_attn.qkv_proj.weight"] = zeros(qkv, H)
            self.params[p + "self_attn.o_proj.weight"] = zeros(H, cfg.num_attention_heads * head_dim(cfg))
            if cfg.qk_layernorm:
                self.params[p + "self_attn.q_norm.weight"] = zeros(head_dim(cfg))
                self.params[p + "self_attn.k_norm.weight"] = zeros(head_dim(cfg))
            if i not in cfg.moe_layer_indices:
                self.params[p + "mlp.gate_up_proj.weight"] = zeros(2 * cfg.ffn_hidden_size, H)
                self.params[p + "mlp.down_proj.weight"] = zeros(H, cfg.ffn_hidden_size)
                continue
            m = p + self._moe
            self.params[m + "gate.weight"] = zeros(cfg.num_experts, H)
            self.params[m + "experts.w13_weight"] = zeros(cfg.num_experts, 2 * F, H)
            self.params[m + "experts.w2_weight"] = zeros(cfg.num_experts, H, F)

    # -- SGLang's load_weights -----------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; unknown names are skipped (and recorded in ``skipped``)."""
        stacked = [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        gate, up, down = self._expert_names
        for name, tensor in weights:
            for param_name, weight_name, shard in stacked:
                if weight_name not in name or "mlp.experts" in name or "block_sparse_moe.experts" in name:
                    continue
                fused = name.replace(weight_name, param_name)
                if fused not in self.params:
                    self.skipped.append(name)
                    break
                self._load_stacked(fused, tensor, shard)
                break
            else:
                expert = self._expert_target(name, gate, up, down)
                if expert is not None:
                    fused, e, shard = expert
                    if fused not in self.params:
                        self.skipped.append(name)
                        continue
                    self._load_expert(fused, tensor, e, shard)
                elif name in self.params:
                    self._copy(name, self.params[name], tensor)
                else:
                    self.skipped.append(name)
                    continue
            self.loaded += 1

    def _expert_target(self, name: str, gate: str, up: str, down: str) -> tuple[str, int, str] | None:
        marker = self._moe + "experts."
        if marker not in name:
            return None
        head, _, rest = name.partition(marker)
        expert, _, tail = rest.partition(".")
        if not expert.isdigit():
            return None
        which = tail.removesuffix(".weight")
        shard = {gate: "w1", up: "w3", down: "w2"}.get(which)
        if shard is None:
            return (name, -1, "")  # an expert tensor the model has no slot for
        param = f"{head}{marker}{'w2' if shard == 'w2' else 'w13'}_weight"
        return param, int(expert), shard

    def _copy(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise SamplerError(
                f"weight {name!r}: got shape {tuple(src.shape)}, the model has {tuple(dst.shape)}"
            )
        dst.copy_(src.to(dst.dtype))

    def _load_stacked(self, fused: str, tensor: torch.Tensor, shard: str | int) -> None:
        param = self.params[fused]
        if isinstance(shard, str):
            start = {"q": 0, "k": self._qkv_rows["q"], "v": self._qkv_rows["q"] + self._qkv_rows["k"]}[shard]
            rows = self._qkv_rows[shard]
        else:
            rows = param.shape[0] // 2
            start = shard * rows
        self._copy(f"{fused}[{shard}]", param[start : start + rows], tensor)

    def _load_expert(self, fused: str, tensor: torch.Tensor, expert: int, shard: str) -> None:
        param = self.params[fused]
        if not 0 <= expert < param.shape[0]:
            raise SamplerError(f"{fused}: expert {expert} outside [0, {param.shape[0]})")
        if shard == "w2":
            self._copy(f"{fused}[{expert}]", param[expert], tensor)
            return
        F = param.shape[1] // 2
        rows = slice(0, F) if shard == "w1" else slice(F, 2 * F)
        self._copy(f"{fused}[{expert}].{shard}", param[expert, rows], tensor)

    # -- back to HF (what the fake's backend generates from) --------------------------------------

    def hf_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        q, k = self._qkv_rows["q"], self._qkv_rows["k"]
        gate, up, down = self._expert_names
        for name, value in self.params.items():
            if name.endswith("self_attn.qkv_proj.weight"):
                p = name.removesuffix("qkv_proj.weight")
                out[p + "q_proj.weight"] = value[:q].clone()
                out[p + "k_proj.weight"] = value[q : q + k].clone()
                out[p + "v_proj.weight"] = value[q + k :].clone()
            elif name.endswith("mlp.gate_up_proj.weight"):
                p = name.removesuffix("gate_up_proj.weight")
                half = value.shape[0] // 2
                out[p + "gate_proj.weight"] = value[:half].clone()
                out[p + "up_proj.weight"] = value[half:].clone()
            elif name.endswith("experts.w13_weight"):
                p = name.removesuffix("w13_weight")
                F = value.shape[1] // 2
                for e in range(value.shape[0]):
                    out[f"{p}{e}.{gate}.weight"] = value[e, :F].clone()
                    out[f"{p}{e}.{up}.weight"] = value[e, F:].clone()
            elif name.endswith("experts.w2_weight"):
                p = name.removesuffix("w2_weight")
                for e in range(value.shape[0]):
                    out[f"{p}{e}.{down}.weight"] = value[e].clone()
            else:
                out[name] = value.clone()
        return out
