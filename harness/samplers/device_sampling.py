"""Token sampling on the model's device, per row, with static shapes and no host sync.

The static decode engine (``static_decode``) samples inside its decode step, so the
step can be captured as a CUDA graph: every per-row setting is a device tensor, and
the random draws come from a counter-based hash instead of a ``torch.Generator``.

For row ``b`` with logits ``z`` (``V`` entries), temperature ``t_b``, top-k ``k_b``,
top-p ``p_b``, key ``s_b`` (the request's seed) and token index ``n``::

    logp   = log_softmax(z / t_b)                    (t_b = 0 -> 1: greedy, log-probs at temperature 1)
    keep   = the k_b largest logp (all for k_b <= 0), then the smallest prefix of them,
             in descending order, whose probability mass reaches p_b (the first always stays)
    r_b    = hash32(s_b mod 2^32) ^ hash32(floor(s_b / 2^32) + golden) ^ hash32(n)
    u_v    = (hash32(r_b ^ hash32(v + golden)) >> 8 + 1/2) / 2^24                    in (0, 1)
    token  = argmax_v [logp_v + g_v],  g_v = -log(-log u_v),  over kept v    (Gumbel-max)
           = argmax_v z_v                                                   when t_b = 0
    behaviour log-prob = logp[token]   (before truncation, as ``local.sample_token``)

Gumbel-max draws ``token`` with probability ``softmax(logp over kept v)``, the same
distribution as ``local.sample_token``'s multinomial draw. ``hash32`` is Wellons'
``lowbias32`` integer mix, computed in int64 and masked to 32 bits (the same integers on
CPU and CUDA).

What seeding guarantees. The host sampler draws from a ``torch.Generator`` per seeded
request; no device kernel reproduces those draws, so the static engine's tokens differ
from the megatron engine's for the same seed. Instead a row's noise is a pure function
of (seed, token index, vocabulary id): a seeded request draws the same uniforms whatever
it is batched with, whichever batch bucket or engine instance runs it, eager or graphed,
on CPU or CUDA. Its tokens are therefore reproducible wherever its logits are; across
devices (and across batch sizes, whose kernels may round differently) logits differ by
round-off, so tokens agree except where two candidates are that close.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' ``lowbias32`` on int64 tensors holding 32-bit values (products stay below 2^64)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``hash32(v + golden)`` for every vocabulary id: the per-column part of the noise, computed once."""
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) + GOLDEN32)


def gumbel_noise(seed_B: torch.Tensor, index: torch.Tensor, vocab_keys_V: torch.Tensor) -> torch.Tensor:
    """``g[b, v] = -log(-log u)`` with ``u`` a pure function of (``seed_B[b]``, ``index``, ``v``); (B, V) fp32.

    ``index`` is the token index: a 0-d or (B,) int64 device tensor.
    """
    row = hash32(seed_B) ^ hash32((seed_B >> 32) + GOLDEN32) ^ hash32(index)  # (B,)
    bits = hash32(row[:, None] ^ vocab_keys_V[None, :]) >> 8  # 24 random bits
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def truncation_mask(logp_B_V: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Bool (B, V): the tokens top-k and then top-p keep (see the module docstring); rules of ``sample_token``."""
    V = logp_B_V.shape[-1]
    sorted_lp, order = torch.sort(logp_B_V, dim=-1, descending=True)
    k = torch.where((top_k_B <= 0) | (top_k_B >= V), V, top_k_B)
    kth = sorted_lp.gather(1, (k - 1)[:, None])
    keep_sorted = sorted_lp >= kth  # ties with the k-th value stay, as on the host
    probs_sorted = torch.where(keep_sorted, sorted_lp.exp(), 0.0)
    before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted  # mass of the better-ranked tokens
    drop = (before >= top_p_B[:, None]) & (top_p_B[:, None] < 1.0)
    keep_sorted = keep_sorted & ~drop
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def sample_on_device(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    seed_B: torch.Tensor,
    index: torch.Tensor,
    vocab_keys_V: torch.Tensor,
    *,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (B,) int64, behaviour log-probs (B,) fp32)`` by the module docstring's rule.

    ``truncate`` is static (a graph per value): False skips the sort when no row uses top-k or top-p.
    """
    logits = logits_B_V.float()
    greedy = temperature_B == 0
    scale = torch.where(greedy, 1.0, temperature_B)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    scored = logp + gumbel_noise(seed_B, index, vocab_keys_V)
    if truncate:
        scored = scored.masked_fill(~truncation_mask(logp, top_k_B, top_p_B), -float("inf"))
    token = torch.where(greedy, logits.argmax(dim=-1), scored.argmax(dim=-1))
    return token, logp.gather(1, token[:, None]).squeeze(1)
