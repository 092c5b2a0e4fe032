"""Run a gloo worker on ``world`` spawned ranks and collect what each wrote to ``rank{r}.pt``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from labrl.ports import free_port


def spawn_ranks(
    target, args: tuple, tmp_path: Path, world: int = 2, join_timeout_s: float = 360
) -> list[dict]:
    """``target(rank, world, port, *args)`` on ``world`` spawned processes; each must exit 0 and save
    ``tmp_path / f"rank{rank}.pt"``. A rank still alive after ``join_timeout_s`` is killed and fails."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=join_timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0] * world, codes
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
