"""All local experts of a megatron-core ``MoELayer`` in two ``torch.nn.functional.grouped_mm`` calls.

``TorchGroupedMLP`` is a drop-in for megatron-core's ``SequentialMLP`` (the
experts module of the local layer spec, which runs one small MLP per expert):
same constructor, same forward contract, same weights, same state-dict names.
It needs no TransformerEngine and no ``grouped_gemm`` package, only
``torch.nn.functional.grouped_mm`` (public since torch 2.10).

The dispatcher hands the experts ``N`` tokens sorted by local expert, with
``tokens_per_expert`` ``n_e`` and one routing probability ``p_i`` per token.
For token ``i`` of expert ``e`` (gated SwiGLU, megatron-core's ``MLP`` without
bias fusion)::

    h_i   = W1_e x_i                          W1_e: (2F, H)  [gate rows; up rows]
    a_i   = act(h_i[:F]) * h_i[F:] * p_i      act = config.activation_func (silu)
    out_i = W2_e a_i                          W2_e: (H, F)

``W1`` is one ``(E, 2F, H)`` parameter and ``W2`` one ``(E, H, F)``, each row
block ``W1[e]`` exactly the ``linear_fc1.weight`` of ``SequentialMLP``'s
``local_experts.e`` (and so for ``W2``); ``grouped_mm(x, W1.mT, offs)`` with
``offs = cumsum(n)`` (int32 cumulative ends) multiplies each expert's rows by
its own matrix in one kernel. With expert tensor parallelism every rank holds
the same row (fc1) and column (fc2) shards ``SequentialMLP`` would; the
dispatcher does the reduction, as for ``SequentialMLP``.

Weights and checkpoints: the state dict is written and read under
``SequentialMLP``'s names (``local_experts.{e}.linear_fc{1,2}.weight``), so
checkpoints, ``export_weights``, ``hf_export.hf_weights`` (the SGLang name map)
and the expert-parallel gather (``parallel_gather``) see the same names and
tensors with either module. Initialisation builds a ``SequentialMLP`` and
stacks its weights, so a seed gives both modules the same weights. What does
not carry over between the two: optimizer state (AdamW's and the fp32 master
copies are per parameter, and this module has 2 parameters where
``SequentialMLP`` has 2E), and megatron-core's distributed checkpointing
(``sharded_state_dict``), which labrl does not use.

Facts about ``grouped_mm`` this relies on (checked on torch 2.13 CPU, fp32 and
bf16; ``tests/learner/test_grouped_experts.py``): offsets must be int32; every
operand's strides must be multiples of 16 bytes (hidden and expert-FFN sizes
multiples of 4 in fp32, of 8 in bf16: ``device.grouped_mm_aligned``); an expert with
no tokens is an empty group (its weight gradient is zero); and its backward
fails on a gradient whose strides are not 16-byte aligned (a transposed one),
so the gradient flowing into each product is made contiguous.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP

from labrl.errors import ConfigError
from labrl.harness.models.device import GROUPED_MM_ALIGN_BYTES, grouped_mm_aligned


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (``grouped_mm``'s backward needs aligned strides)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, weight_E_out_in: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[i] = weight[e(i)] @ x[i]`` for the rows ``offsets[e-1] <= i < offsets[e]`` of expert ``e``."""
    out = torch.nn.functional.grouped_mm(x, weight_E_out_in.transpose(1, 2), offs=offsets)
    return _ContiguousGrad.apply(out)


class TorchGroupedMLP(MegatronModule):
    """megatron-core's experts contract on ``grouped_mm``; see the module docstring."""

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None) -> None:
        super().__init__(config=config)
        _check_config(config)
        # SequentialMLP's own construction gives the weights (same RNG draws, init and
        # tensor-parallel attributes as the module this one replaces); its experts are then dropped.
        sequential = SequentialMLP(num_local_experts, config, submodules, pg_collection=pg_collection)
        experts = list(sequential.local_experts)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = (
            sequential.ep_group,
            sequential.tp_group,
            sequential.dp_group,
        )
        self.weight1 = _stack([e.linear_fc1.weight for e in experts])  # (E, 2F/tp, H)
        self.weight2 = _stack([e.linear_fc2.weight for e in experts])  # (E, H, F/tp)
        ffn = self.weight2.shape[2]
        if not grouped_mm_aligned(config.hidden_size, ffn, config.params_dtype):
            raise ConfigError(
                f"TorchGroupedMLP: hidden size {config.hidden_size} and expert FFN size {ffn} per rank "
                f"must be multiples of {GROUPED_MM_ALIGN_BYTES} bytes in {config.params_dtype} "
                "(grouped_mm's stride alignment); use SequentialMLP for this shape"
            )

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """``(tokens sorted by local expert, tokens per expert, probs) -> (out, None)``."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # SequentialMLP's rule: scale inputs, not outputs
            if self.config.moe_router_topk != 1:
                raise ConfigError("moe_apply_probs_on_input only works with moe_router_topk=1")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = _grouped_linear(x, self.weight1, offsets)
        a = (self._activation(h) * probs.unsqueeze(-1)).to(h.dtype)
        return _grouped_linear(a, self.weight2, offsets), None

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """megatron-core ``MLP``'s activation without bias fusion: ``act(gate) * (up + offset)`` when gated."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(h)
        gate, up = torch.chunk(h, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            up = up.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (up + config.glu_linear_offset)

    def _expert_keys(self, prefix: str):
        """``(state-dict key, stacked parameter, expert)`` under SequentialMLP's names."""
        for e in range(self.num_local_experts):
            for linear, stacked in (("linear_fc1", self.weight1), ("linear_fc2", self.weight2)):
                yield f"{prefix}local_experts.{e}.{linear}.weight", stacked, e

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, stacked, e in self._expert_keys(prefix):
            destination[key] = stacked[e] if keep_vars else stacked.detach()[e]
            # SequentialMLP's linears write an empty extra state: same keys, so either module loads either's
            destination[key.removesuffix("weight") + "_extra_state"] = None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = set()
        with torch.no_grad():
            for key, stacked, e in self._expert_keys(prefix):
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if value.shape != stacked[e].shape:
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                        f"the shape in current model is {tuple(stacked[e].shape)}."
                    )
                    continue
                stacked[e].copy_(value)
        if strict:  # torch's rule: unexpected keys are reported under strict loading only
            unexpected_keys.extend(
                k
                for k in state_dict
                if k.startswith(prefix) and k not in expected and not k.endswith("_extra_state")
            )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        raise ConfigError(
            "TorchGroupedMLP has no megatron distributed checkpoint layout: labrl checkpoints are "
            "torch state dicts under SequentialMLP's names (MegatronLearner.save_checkpoint)"
        )


def _stack(weights: list[torch.Tensor]) -> torch.nn.Parameter:
    """One ``(E, out, in)`` parameter from E expert weights, with the first one's parallel attributes.

    ``allreduce`` (False for expert-parallel weights) and the tensor-parallel flags are what the
    learner's grad-norm reduction reads; the partition dimension moves up by the new expert axis.
    """
    stacked = torch.nn.Parameter(torch.stack([w.detach() for w in weights]))
    first = weights[0]
    for name in ("allreduce", "tensor_model_parallel", "partition_stride"):
        if hasattr(first, name):
            setattr(stacked, name, getattr(first, name))
    if hasattr(first, "partition_dim"):
        setattr(stacked, "partition_dim", first.partition_dim + 1)  # noqa: B010 - megatron's ad-hoc attribute
    return stacked


def _check_config(config) -> None:
    """What this module does not compute: fail at build time rather than compute something else."""
    unsupported = {
        "add_bias_linear (expert biases)": config.add_bias_linear,
        "bias_activation_fusion": config.bias_activation_fusion,
        "use_te_activation_func": getattr(config, "use_te_activation_func", False),
        "fp8 / fp4": bool(config.fp8 or config.fp4),
        "moe_latent_size": getattr(config, "moe_latent_size", None) is not None,
    }
    named = [name for name, on in unsupported.items() if on]
    if named:
        raise ConfigError(
            f"TorchGroupedMLP does not support {', '.join(named)}: use SequentialMLP or TEGroupedMLP"
        )
