"""A gloo rank for ``graph_memory.agreed``: rank r may keep a graph iff r is not in ``refusing``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from labrl.harness.learners.graph_memory import agreed


def main(rank: int, world: int, port: int, out_dir: str, refusing: tuple[int, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got = [agreed(rank not in refusing, torch.device("cpu")), agreed(True, torch.device("cpu"))]
    finally:
        torch.distributed.destroy_process_group()
    torch.save({"agreed": got}, Path(out_dir) / f"rank{rank}.pt")
