"""One rank of the expert-parallel (EP=2, gloo) check of ``TorchGroupedMLP`` against ``SequentialMLP``.

Each rank initialises torch.distributed over gloo and megatron-core's parallel state with
expert parallelism 2, builds one MoE layer per experts module from the same seed (each rank
holds 4 of the 8 experts; the allgather dispatcher sends every rank's tokens to every rank's
experts), runs forward and backward on its own tokens and writes what the parent compares.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from labrl.harness.models import ParallelConfig, get_preset

CFG = get_preset("tiny-moe").model_copy(
    update={"num_layers": 1, "hidden_size": 32, "moe_ffn_hidden_size": 16}
)
S, B = 6, 2  # tokens per sequence, sequences per rank


def moe_layer(tconfig, experts: str):
    from megatron.core.transformer.spec_utils import build_module

    from labrl.harness.models.build import decoder_block_spec

    spec = decoder_block_spec(tconfig, use_transformer_engine=False, experts=experts)
    torch.manual_seed(0)  # the same router and experts for both modules
    return build_module(spec.layer_specs[0].submodules.mlp, config=tconfig)


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    from megatron.core import parallel_state

    from labrl.harness.models import device as dev
    from labrl.harness.models.cpu_compat import apply_workarounds

    torch.set_num_threads(1)
    # megatron-core's sequence-parallel gather and scatter (the allgather dispatcher's exchange) allocate
    # their output on ``torch.cuda.current_device()``; in this CPU-only process that is the CPU
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    cpu = torch.device("cpu")
    apply_workarounds(dev.workarounds(cpu, dev.detect_capabilities()))
    tconfig = CFG.transformer_config(ParallelConfig(), cpu=True)
    tconfig.expert_model_parallel_size = world
    gen = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(S, B, CFG.hidden_size, generator=gen)
    weight = torch.randn(S, B, CFG.hidden_size, generator=gen)
    result: dict = {"rank": rank}
    for experts in ("SequentialMLP", "TorchGroupedMLP"):
        layer = moe_layer(tconfig, experts)
        x = x0.clone().requires_grad_(True)
        out, _ = layer(x)
        (out * weight).sum().backward()
        if experts == "SequentialMLP":
            first = layer.experts.local_experts[0]
            allreduce = [first.linear_fc1.weight.allreduce, first.linear_fc2.weight.allreduce]
            grads = {
                f"local_experts.{e}.{name}": getattr(m, name).weight.grad
                for e, m in enumerate(layer.experts.local_experts)
                for name in ("linear_fc1", "linear_fc2")
            }
        else:
            allreduce = [layer.experts.weight1.allreduce, layer.experts.weight2.allreduce]
            grads = {
                f"local_experts.{e}.{name}": stacked.grad[e]
                for e in range(layer.experts.num_local_experts)
                for name, stacked in (
                    ("linear_fc1", layer.experts.weight1),
                    ("linear_fc2", layer.experts.weight2),
                )
            }
        result[experts] = {
            "type": type(layer.experts).__name__,
            "out": out.detach(),
            "x_grad": x.grad,
            "router_grad": layer.router.weight.grad,
            "expert_grads": grads,
            "state": {k: v for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)},
            "state_keys": list(layer.state_dict()),
            "allreduce": allreduce,
        }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
