"""Router replay at TP > 1 with sequence parallelism: routes gathered across SP shards, scattered back."""

from __future__ import annotations

import pytest
import sp_rank_worker
import torch
import torch.multiprocessing as mp

from labrl.errors import ConfigError
from labrl.harness.models.routing import (
    from_megatron_layout,
    gather_sequence_parallel,
    scatter_sequence_parallel,
    to_megatron_layout,
)
from labrl.ports import free_port

B, T, L, K = sp_rank_worker.B, sp_rank_worker.T, sp_rank_worker.L, sp_rank_worker.K
_routes = sp_rank_worker.routes


@pytest.mark.parametrize("tp", [2, 4])
def test_scatter_gives_each_rank_its_sequence_slice_and_gather_restores(tp):
    routed = _routes()
    per_rank = [to_megatron_layout(routed, sp_rank=r, sp_size=tp) for r in range(tp)]  # [rank][layer]
    chunk = T // tp
    for r in range(tp):
        for layer in range(L):
            # rank r routes positions [r*chunk, (r+1)*chunk) of every sequence, sequence-major (s * B + b)
            want = routed[:, r * chunk : (r + 1) * chunk, layer].permute(1, 0, 2).reshape(chunk * B, K)
            assert torch.equal(per_rank[r][layer], want)
    gathered = [gather_sequence_parallel([per_rank[r][layer] for r in range(tp)]) for layer in range(L)]
    assert all(torch.equal(g, w) for g, w in zip(gathered, to_megatron_layout(routed), strict=True))
    assert torch.equal(from_megatron_layout(gathered, B), routed)


def test_a_shard_stored_as_whole_is_not_the_sequence():
    """What broke before: one rank's routes replayed as the whole sequence's."""
    routed = _routes()
    shard = to_megatron_layout(routed, sp_rank=1, sp_size=2)[0]
    assert shard.shape[0] == T * B // 2
    assert not torch.equal(shard, to_megatron_layout(routed)[0][: shard.shape[0]])


def test_scatter_refuses_lengths_not_divisible_by_the_sp_size():
    with pytest.raises(ConfigError, match="not divisible by the sequence-parallel size 3"):
        scatter_sequence_parallel(torch.zeros(T * B, K, dtype=torch.long), rank=0, size=3, batch_size=B)
    with pytest.raises(ConfigError, match="different shapes"):
        gather_sequence_parallel([torch.zeros(4, K), torch.zeros(6, K)])


@pytest.mark.timeout(300)
def test_all_gather_over_a_gloo_group_matches_the_whole_sequence():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=sp_rank_worker.rank_main, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    want = to_megatron_layout(_routes())
    for rank in (0, 1):
        assert all(torch.equal(torch.tensor(g), w) for g, w in zip(results[rank], want, strict=True))
