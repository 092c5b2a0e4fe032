"""fp32 master weights for a model whose parameters are bf16.

Why our own and not megatron-core's ``Float16OptimizerWithFloat16Params``
(megatron/core/optimizer/optimizer.py, 0.16.1): that one does run without
TransformerEngine and Apex (it falls back to torch's AdamW and
``local_multi_tensor_applier``), but it accepts only parameters whose
``param.type()`` is ``torch.cuda.BFloat16Tensor``/``HalfTensor``/``FloatTensor``
and allocates its flags with ``device='cuda'``, so no CPU test can exercise it;
``get_megatron_optimizer`` also expects the model wrapped in megatron's DDP
(``ddp_config``, ``param.main_grad``) and brings its own clipping, schedule and
checkpoint layout. The learner keeps its own clip, LR schedule and checkpoint
format; what it needs from mixed precision is the three lines below.

- the optimizer steps fp32 copies ``master_i`` of the bf16 parameters ``p_i``;
- after each micro-batch's backward: ``master_i.grad += float32(p_i.grad)``,
  ``p_i.grad = None`` (gradients accumulate in fp32 across micro-batches);
- after the optimizer step: ``p_i <- bf16(master_i)``.
"""

from __future__ import annotations

from typing import TypedDict, Unpack

import torch


def _copy_parallel_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The tensor-parallel and expert flags the grad-norm reduction reads (``allreduce``, TP duplicate)."""
    from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

    copy_tensor_model_parallel_attributes(dst, src)
    for name in ("allreduce", "shared"):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


class FP32MasterParams:
    """fp32 copies of ``params`` that an optimizer steps; see the module docstring."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = params
        self.master_params: list[torch.nn.Parameter] = []
        for p in params:
            master = torch.nn.Parameter(p.detach().to(torch.float32).clone())
            _copy_parallel_attributes(p, master)
            self.master_params.append(master)

    def accumulate_grads(self) -> None:
        """Move the model's (bf16) gradients into the fp32 master gradients."""
        for p, master in zip(self.model_params, self.master_params, strict=True):
            if p.grad is None:
                continue
            if master.grad is None:
                master.grad = p.grad.detach().to(torch.float32)
            else:
                master.grad.add_(p.grad.detach())
            p.grad = None

    def zero_grad(self) -> None:
        for p, master in zip(self.model_params, self.master_params, strict=True):
            p.grad = None
            master.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        # one multi-tensor copy (rounding to the model's dtype) where torch has the kernel for it
        model: list[torch.Tensor] = list(self.model_params)
        master: list[torch.Tensor] = list(self.master_params)
        torch._foreach_copy_(model, master)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Reset the master weights to the model's (after loading weights into the model)."""
        for p, master in zip(self.model_params, self.master_params, strict=True):
            master.copy_(p)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach() for m in self.master_params]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.master_params):
            raise ValueError(f"{len(tensors)} master tensors for {len(self.master_params)} parameters")
        for master, t in zip(self.master_params, tensors, strict=True):
            master.copy_(t)
        self.copy_to_model()


class AdamWOptions(TypedDict, total=False):
    """The AdamW settings labrl passes (torch's defaults for the others)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def adamw_with_precision(
    params: list[torch.nn.Parameter], **adamw: Unpack[AdamWOptions]
) -> tuple[torch.optim.AdamW, FP32MasterParams | None]:
    """AdamW for ``params`` in their dtype: over fp32 master copies when they are low precision.

    The one place that decides (``device.optimizer_wrapper``, and the kernel:
    ``device.adamw_kernel``) for the learner and the SFT warm start alike. With a
    master copy the caller follows the module docstring: ``accumulate_grads``
    after each backward, clip and step the master parameters, then ``copy_to_model``.
    """
    from labrl.harness.models import device as dev

    dtype = params[0].dtype if params else torch.float32
    master = FP32MasterParams(params) if dev.optimizer_wrapper(dtype) == "fp32_master" else None
    stepped = master.master_params if master is not None else params
    device = params[0].device if params else dev.HOST
    fused = {"fused": True} if dev.adamw_kernel(device) == "fused" else {}
    return torch.optim.AdamW(stepped, **adamw, **fused), master
