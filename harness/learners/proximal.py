"""Where a ``train_step`` takes its proximal log-probs from: a no-grad forward of its own, or the loss forward.

The proximal policy ``pi_prox`` is the learner at the start of the batch.
With one optimizer step per batch (``minibatches = epochs = 1``) the weights
do not change before that step, so ``pi_prox`` equals the loss forward's
log-probs, detached: the no-grad forward over the batch computes nothing new.
It can be dropped when every term that reads ``pi_prox`` is available when the
micro-batch that needs it runs:

    optimizer steps per batch > 1          separate     later steps need pi_prox of the batch start
    proximal_forward = "separate"          separate     asked for (the path before issue 26; comparisons)
    one micro-batch                        same         the whole batch is in the one forward
    a whole-batch term (M2PO)              kept graphs  the mask ranks every row's pi_prox before the
                                                        first backward (objectives.whole_batch_terms):
                                                        every loss forward runs first and keeps its
                                                        graph while memory allows, the backward passes
                                                        follow (graph_memory); a micro-batch that does
                                                        not fit gets a no-grad forward, as separate
      ... with graph_memory_fraction = 0   separate
    otherwise                              same         per token / per sequence terms: each micro-batch
                                                        uses its own forward (objectives.prepare_rows)

The non-finite batch skip is not a whole-batch term: a micro-batch whose
proximal log-probs are non-finite drops the gradients accumulated so far
before any optimizer step, which leaves weights, optimizer and version as the
separate check does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ProximalForwardChoice = Literal["auto", "separate"]


@dataclass(frozen=True)
class ProximalForward:
    separate: bool  # a no-grad forward over the batch before the first backward
    reason: str
    # loss forwards first, their graphs kept while memory allows, then the backward passes
    keep_graphs: bool = False


def proximal_forward(
    *,
    choice: ProximalForwardChoice,
    optimizer_steps: int,
    micro_batches: int,
    whole_batch_terms: Sequence[str],
    graph_memory_fraction: float,
) -> ProximalForward:
    """The rule of the module docstring for one batch."""
    if optimizer_steps > 1:
        return ProximalForward(
            True, f"{optimizer_steps} optimizer steps per batch: pi_prox is the batch start"
        )
    if choice == "separate":
        return ProximalForward(True, "learner.proximal_forward=separate")
    if micro_batches == 1:
        return ProximalForward(False, "one micro-batch: pi_prox is its forward, detached")
    if whole_batch_terms:
        needs = f"{', '.join(whole_batch_terms)} needs the whole batch's pi_prox before the first backward"
        if graph_memory_fraction == 0:
            return ProximalForward(True, f"{needs}; learner.graph_memory_fraction=0 keeps no graph")
        return ProximalForward(
            False, f"{needs}: loss forwards first, their graphs kept while memory allows", keep_graphs=True
        )
    return ProximalForward(
        False, "per-token and per-sequence terms only: each micro-batch's own forward, detached"
    )
