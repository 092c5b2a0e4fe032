"""One next-token forward and backward of a GPT model, for tests that compare two models' gradients."""

from __future__ import annotations

import torch


def logits_after_backward(
    model, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The model's logits (fp32) after backpropagating the next-token cross-entropy of ``tokens``."""
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask)
    torch.nn.functional.cross_entropy(out[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return out.float()
