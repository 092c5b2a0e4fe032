"""On-device sampling (``samplers.device_sampling``): the host sampler's distribution and truncation rules,
with per-row noise that is a pure function of (seed, token index, vocabulary id)."""

from __future__ import annotations

import pytest
import torch

from labrl.harness.samplers.device_sampling import (
    gumbel_noise,
    hash32,
    sample_on_device,
    truncation_mask,
    vocab_keys,
)
from labrl.harness.samplers.local import sample_token
from labrl.harness.samplers.static_batch import bucket, row_end
from labrl.harness.samplers.static_decode import capacity_bucket
from labrl.harness.types import SamplingParams

CPU = torch.device("cpu")


def _sample(logits, *, temperature=1.0, top_k=-1, top_p=1.0, seeds=None, index=0, truncate=None):
    B, V = logits.shape
    seeds = torch.arange(B, dtype=torch.long, device=CPU) if seeds is None else seeds
    full = lambda v, dt: torch.full((B,), v, dtype=dt, device=CPU)  # noqa: E731
    return sample_on_device(
        logits,
        full(temperature, torch.float32),
        full(top_k, torch.long),
        full(top_p, torch.float32),
        seeds,
        torch.tensor(index, dtype=torch.long, device=CPU),
        vocab_keys(V, CPU),
        truncate=(top_k > 0 or top_p < 1) if truncate is None else truncate,
    )


def test_hash32_known_values_and_range():
    x = torch.tensor([0, 1, 2**32 - 1], dtype=torch.long, device=CPU)
    # lowbias32(0) = 0; every value stays a 32-bit unsigned integer
    got = hash32(x)
    assert got[0] == 0 and bool(((got >= 0) & (got < 2**32)).all())
    assert len(set(hash32(torch.arange(10_000, device=CPU)).tolist())) == 10_000  # a bijection on 32 bits


def test_frequencies_follow_the_tempered_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1], device=CPU)
    n = 40_000
    logits = torch.log(probs).expand(n, 4).contiguous()
    tokens, logp = _sample(logits, temperature=2.0)
    want = torch.softmax(torch.log(probs) / 2.0, -1)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert float((freq - want).abs().max()) < 0.01  # 4 sigma of a binomial at n = 40k is ~0.01
    assert torch.allclose(logp, torch.log(want)[tokens], atol=1e-6)


def test_top_k_and_top_p_keep_the_smallest_prefix():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(64, 50, generator=gen) * 2, -1)
    for top_k, top_p in ((5, 1.0), (-1, 0.7), (10, 0.5), (0, 0.95), (50, 1.0), (3, 0.01)):
        mask = truncation_mask(
            logp,
            torch.full((64,), top_k, dtype=torch.long, device=CPU),
            torch.full((64,), top_p, dtype=torch.float32, device=CPU),
        )
        for b in range(64):
            order = torch.argsort(logp[b], descending=True).tolist()
            ranked = order[:top_k] if top_k > 0 else order
            kept, mass = [], 0.0
            for v in ranked:  # the definition: add tokens best first until their mass reaches top_p
                if mass >= top_p and top_p < 1.0:
                    break
                kept.append(v)
                mass += float(logp[b, v].exp())
            assert set(torch.nonzero(mask[b]).flatten().tolist()) == set(kept), (top_k, top_p, b)


def test_the_host_sampler_truncates_by_the_same_rule():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], device=CPU))
    gen = torch.Generator().manual_seed(0)
    for params, allowed in ((SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.8), {0, 1})):
        assert {sample_token(logits, params, gen)[0] for _ in range(200)} == allowed
        row = logits[None]
        mask = truncation_mask(
            torch.log_softmax(row, -1),
            torch.tensor([params.top_k], device=CPU),
            torch.tensor([params.top_p], device=CPU),
        )
        assert set(torch.nonzero(mask[0]).flatten().tolist()) == allowed


def test_truncated_draws_stay_in_the_kept_set_and_greedy_rows_take_the_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(512, 30, generator=gen)
    tokens, _ = _sample(logits, top_k=3)
    top3 = torch.topk(logits, 3, dim=-1).indices
    assert bool((top3 == tokens[:, None]).any(-1).all())
    greedy, logp = _sample(logits, temperature=0.0)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(1, greedy[:, None])[:, 0])


def test_noise_is_a_function_of_seed_index_and_token_only():
    keys = vocab_keys(100, CPU)
    seeds = torch.tensor([7, 8, 7, 2**40 + 7], dtype=torch.long, device=CPU)
    g = gumbel_noise(seeds, torch.tensor(3, device=CPU), keys)
    assert torch.equal(g[0], g[2])  # same seed, same index: same draws whatever the row
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[3])  # the high bits of a seed count
    alone = gumbel_noise(seeds[1:2], torch.tensor(3, device=CPU), keys)
    assert torch.equal(alone[0], g[1])  # independent of the batch around it
    assert not torch.equal(gumbel_noise(seeds, torch.tensor(4, device=CPU), keys)[0], g[0])


@pytest.mark.parametrize(
    "n, sizes, want", [(1, (1, 8, 32), 1), (5, (1, 8, 32), 8), (32, (1, 8, 32), 32), (40, (1, 8, 32), 40)]
)
def test_batch_bucket(n, sizes, want):
    assert bucket(n, sizes) == want


def test_capacity_bucket_is_a_power_of_two_capped_by_the_context():
    assert capacity_bucket(10, 2048) == 128
    assert capacity_bucket(129, 2048) == 256
    assert capacity_bucket(1500, 1024) == 1024


def test_row_end():
    assert row_end([5, 6, 7, 8], 4, (7,)) == (3, "stop")
    assert row_end([5, 6, 7, 8], 2, (7,)) == (2, "length")
    assert row_end([5, 6, 7, 8], 4, ()) == (4, "length")
