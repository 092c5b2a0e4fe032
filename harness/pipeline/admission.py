"""Admission control: pace the start of new episodes so staleness stays bounded.

Discarding finished episodes that came back too late biases training against
slow experiments, so the bound is enforced *before* an episode starts. A group
started now will be trained in the batch that contains it. With

- ``v``  the learner version now, ``busy`` 1 while a train step runs (the
  next batch is trained at ``v + 1``), 0 otherwise,
- ``ahead`` the groups that will be trained before it: kept groups waiting
  in the buffer plus those of the ``n`` groups still in flight that will be
  kept (only kept groups fill batches). That count is random, and its mean
  ``keep_rate x n`` is optimistic whenever the real count crosses a batch
  boundary the mean does not, so admission takes its upper quantile:
  ``ceil(n p + z sqrt(n p (1 - p)))`` capped at ``n`` (``p = keep_rate``,
  one-sided ``z = KEEP_RATE_Z``),
- ``B`` groups per batch, ``s`` the sampler version now,

the predicted learner version at training time is

    v_train = v + busy + floor(ahead / B)

and every token of the new group carries a version >= s (in-flight weight
updates only make later tokens newer), so its staleness is at most
``v_train - s``. The group may start iff ``v_train - s <= max_staleness``.

``keep_rate`` < 1 (dynamic sampling drops zero-variance groups) lets more
groups run ahead. The prediction must not be optimistic: a keep rate guessed
too low admits groups that will be trained later than predicted, past the
bound. So admission uses a pessimistic estimate, the Wilson upper bound
(one-sided, ``z = KEEP_RATE_Z``) of the rate among the last ``KEEP_WINDOW``
finished groups (``k`` kept of ``n``, ``p = k / n``):

    keep_rate = max(KEEP_RATE_FLOOR,
                    (p + z^2/(2n) + z sqrt(p (1 - p) / n + z^2 / (4 n^2))) / (1 + z^2 / n))

It is 1 before any group finished, follows a drop rate that changes within a
few dozen groups (a cumulative rate lags by hundreds), and is higher the
fewer groups it rests on. The floor keeps a burst of drops from letting
dozens of groups run ahead of the learner.

The buffer trains the groups that started first (``buffer.started_first``),
so a group is not overtaken by groups admitted after it. What the bound
promises: it is a target that admission holds for every group that finishes
in about its predicted time. A group that takes much longer than the groups
around it (a heavy-tailed env, a lab queue) misses batches while it runs and
is trained later than predicted; it is trained first once it lands, with the
objective's corrections, and counted (``staleness/over_max_episodes``), never
dropped: a slow experiment is paid for, and throwing it away would bias
training against slow tasks.

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

#: one-sided z of the keep-rate upper bound (95 %)
KEEP_RATE_Z = 1.645
#: the least keep rate admission assumes, whatever the window says
KEEP_RATE_FLOOR = 0.25


@dataclass(frozen=True)
class AdmissionState:
    learner_version: int
    learner_busy: bool
    sampler_version: int
    buffered_groups: int
    inflight_groups: int


def pessimistic_keep_rate(kept: int, seen: int, z: float = KEEP_RATE_Z) -> float:
    """The Wilson upper bound of ``kept / seen`` at one-sided ``z``, floored at ``KEEP_RATE_FLOOR``; 1 if ``seen == 0``."""
    if seen <= 0:
        return 1.0
    if not 0 <= kept <= seen:
        raise ValueError(f"kept must be in [0, seen] (got kept={kept}, seen={seen})")
    p = kept / seen
    z2n = z * z / seen
    upper = (p + z2n / 2 + z * math.sqrt(p * (1 - p) / seen + z2n / (4 * seen))) / (1 + z2n)
    return max(KEEP_RATE_FLOOR, min(1.0, upper))


def kept_upper(inflight: int, keep_rate: float, z: float = KEEP_RATE_Z) -> int:
    """How many of ``inflight`` groups will be kept, at worst: ``ceil(n p + z sqrt(n p (1 - p)))`` capped at ``n``."""
    n, p = inflight, keep_rate
    # the epsilon keeps 0.5 x 8 = 4.000000001 from rounding up to 5
    return min(n, math.ceil(n * p + z * math.sqrt(n * p * (1 - p)) - 1e-9))


def predicted_train_version(state: AdmissionState, batch_groups: int, keep_rate: float) -> int:
    ahead = state.buffered_groups + kept_upper(state.inflight_groups, keep_rate)
    return state.learner_version + int(state.learner_busy) + ahead // batch_groups


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
