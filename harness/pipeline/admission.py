"""Admission control: pace the start of new episodes so staleness stays bounded.

Discarding finished episodes that came back too late biases training against
slow experiments, so the bound is enforced *before* an episode starts. A group
started now will be trained in the batch that contains it. With

- ``v``  the learner version now, ``busy`` 1 while a train step runs (the
  next batch is trained at ``v + 1``), 0 otherwise,
- ``ahead`` the groups that will be trained before it: kept groups waiting
  in the buffer plus ``keep_rate`` x the groups still in flight (only kept
  groups fill batches),
- ``B`` groups per batch, ``s`` the sampler version now,

the predicted learner version at training time is

    v_train = v + busy + floor(ahead / B)

and every token of the new group carries a version >= s (in-flight weight
updates only make later tokens newer), so its staleness is at most
``v_train - s``. The group may start iff ``v_train - s <= max_staleness``.

``keep_rate`` < 1 (dynamic sampling drops zero-variance groups) lets more
groups run ahead; it is estimated from the run so far. A group whose real
staleness exceeds the bound anyway (a slow env, a keep-rate misestimate) is
trained with the objective's corrections and counted, never dropped.

The run's end bounds admission too: a group is started only if the batch it
is predicted to join is one of the run's, ``steps_done + busy + floor(ahead / B)
< total_steps``. A group past the end would be generated (for a lab env: paid
for) and never trained.

``sync`` is this rule with ``max_staleness = 0`` and ``keep_rate = 1``:
exactly one batch is generated, then trained. ``one_step_off`` uses
``max_staleness = 1`` with weight updates deferred until no episode is in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionState:
    learner_version: int
    learner_busy: bool
    sampler_version: int
    buffered_groups: int
    inflight_groups: int


def predicted_train_version(state: AdmissionState, batch_groups: int, keep_rate: float) -> int:
    ahead = state.buffered_groups + keep_rate * state.inflight_groups
    # a tiny epsilon keeps 0.999999 x 8 from rounding below 8 and admitting one group too many
    return state.learner_version + int(state.learner_busy) + math.floor(ahead / batch_groups + 1e-9)


def predicted_staleness(state: AdmissionState, batch_groups: int, keep_rate: float) -> int:
    return predicted_train_version(state, batch_groups, keep_rate) - state.sampler_version


def may_start(state: AdmissionState, batch_groups: int, keep_rate: float, max_staleness: int) -> bool:
    return predicted_staleness(state, batch_groups, keep_rate) <= max_staleness


def trained_before_end(
    state: AdmissionState, batch_groups: int, keep_rate: float, steps_done: int, total_steps: int
) -> bool:
    """Whether a group started now joins a batch the run still trains (see the module docstring)."""
    ahead_batches = predicted_train_version(state, batch_groups, keep_rate) - state.learner_version
    return steps_done + ahead_batches < total_steps
