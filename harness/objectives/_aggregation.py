"""Loss aggregation with a denominator fixed once for the global batch.

With ``l_{i,t}`` the per-token loss, ``v_{i,t}`` the valid-token mask, ``n_i``
the valid tokens of sequence ``i``, ``N_tok = sum n_i`` and ``N_seq`` the
number of sequences with ``n_i > 0`` over the GLOBAL batch:

    token_mean           L = sum_{i,t} v l / N_tok                       (DAPO, Olmo 3)
    seq_mean_token_mean  L = sum_i (sum_t v l / n_i) / N_seq             (GRPO)
    seq_sum_constant     L = sum_{i,t} v l / (C * N_seq)                 (Dr.GRPO: C = max generation length)

The numerator is a sum over rows, so a micro-batch (a subset of whole rows)
contributes its partial sum divided by the global denominator, and the sum of
micro-batch losses (and their gradients) equals the whole-batch value. A
denominator computed per micro-batch would instead reweight tokens by the size
of the micro-batch they landed in. Empty batches use a denominator of 1 (loss 0).
"""

from __future__ import annotations

import torch

from labrl.errors import ConfigError


def valid_counts(valid_B_T: torch.Tensor) -> tuple[int, int]:
    """``(N_tok, N_seq)`` of a valid-token mask: its valid tokens and the rows holding any.

    A host read: call it once per batch (or mini-batch) and pass the counts on,
    never per micro-batch, where each read would wait for the device."""
    n_tok, n_seq = torch.stack([valid_B_T.sum(), valid_B_T.any(dim=1).sum()]).tolist()
    return n_tok, n_seq


def global_denominator(
    kind: str, num_valid_tokens: int, num_valid_seqs: int, constant: float | None = None
) -> float:
    """The global divisor for ``kind`` from the batch's ``valid_counts`` (computed once, before micro-batching)."""
    if kind == "token_mean":
        return float(max(num_valid_tokens, 1))
    if kind == "seq_mean_token_mean":
        return float(max(num_valid_seqs, 1))
    if kind == "seq_sum_constant":
        if constant is None:
            raise ConfigError("aggregation=seq_sum_constant requires aggregation_constant")
        return float(constant) * max(num_valid_seqs, 1)
    raise ConfigError(
        f"aggregation must be token_mean, seq_mean_token_mean or seq_sum_constant (got {kind!r})"
    )


def aggregate(
    kind: str, loss_B_T: torch.Tensor, valid_B_T: torch.Tensor, denominator: float, *, masked: bool = False
) -> torch.Tensor:
    """Scalar ``sum(numerator) / denominator``; invalid tokens contribute exactly 0 (even if they hold inf/nan).

    ``masked``: ``loss_B_T`` is already 0 off ``valid_B_T`` (a loss masked to a subset of it), so the
    mask is not applied again."""
    masked_loss = loss_B_T if masked else torch.where(valid_B_T, loss_B_T, 0.0)
    if kind == "seq_mean_token_mean":
        n_B = valid_B_T.sum(dim=1).clamp(min=1)
        return (masked_loss.sum(dim=1) / n_B).sum() / denominator
    if kind in ("token_mean", "seq_sum_constant"):
        return masked_loss.sum() / denominator
    raise ConfigError(
        f"aggregation must be token_mean, seq_mean_token_mean or seq_sum_constant (got {kind!r})"
    )
