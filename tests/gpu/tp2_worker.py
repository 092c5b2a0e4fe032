"""One rank of the real TP=2 learner test (a spawned process on its own GPU, NCCL)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

B, T = 2, 16  # T divisible by the TP size: megatron's sequence parallelism splits it


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.cuda.set_device(rank)
    from weight_sync_support import MODELS

    from labrl.harness.learners import LearnerConfig, MegatronLearner
    from labrl.harness.models.config import ParallelConfig

    cfg = MODELS["qwen3_moe"]
    learner = MegatronLearner(
        LearnerConfig(model=cfg, parallel=ParallelConfig(tensor_parallel=world), precision="fp32")
    )
    local = {
        k: v.detach().cpu() for k, v in learner.model.state_dict().items() if not k.endswith("_extra_state")
    }
    full = {k: v.cpu() for k, v in learner.export_weights().items()}
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    routed = learner.route(tokens)  # gathered over the sequence-parallel ranks
    free = learner.logprobs(tokens)
    replayed = learner.logprobs(tokens, routed)  # scattered back to each rank's slice
    torch.save(
        {
            "local": local,
            "full": full,
            "routed": routed,
            "free": free,
            "replayed": replayed,
            "sp": learner.sp.size,
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()
