"""The closed-form steady state of a layout: which component binds, how many episodes are in flight,
what staleness admission lets through.

A ``Workload`` says what one episode costs (turns, tokens per turn, env seconds per
call) and how often a group is kept; a ``Layout`` says what runs it (sampler
rate and KV-cache slots, env-worker slots, the learner's step time, the pipeline
knobs). With

- ``G`` episodes per group, ``B`` groups per batch, ``p`` the true keep rate
  (dynamic sampling keeps a fraction ``p`` of finished groups),
- ``k`` turns per episode, ``m`` generated tokens per turn, ``e`` mean env seconds per episode
  (reset + ``k`` steps),
- the sampler a batched decoder (``decode``): a decode step over ``b`` sequences takes
  ``t(b) = a + c b`` seconds, ``b`` at most ``kv_slots``; ``R = kv_slots / t(kv_slots)`` its tokens/s
  with every slot busy, and ``a = kv_slots / R - c kv_slots``. ``c = 0`` (the default) is the fixed
  rate: every sequence decodes at ``r = R / kv_slots`` whatever the batch,
- ``b`` the sequences decoding at once in the steady state, ``t_gen = k m t(b)`` and
  ``T = t_gen + e`` the mean episode duration, ``D`` the learner's seconds per step,

the ceilings on the episode rate ``X`` (episodes started per second) are

    learner:      X_L = B G / (p D)             (the learner never idles)
    sampler:      X_S = kv_slots / (k m t(kv_slots)) = R / (k m)
                  (at most kv_slots sequences decode at once; b / t(b) grows with b)
    env workers:  X_E = env_slots / e           (at most env_slots env calls at once)
    in flight:    X_N = N / (k m t(b_N) + e)    (Little's law, N episodes open at once)
    driver:       X_D = 1 / c_D                 (the orchestrator's CPU seconds c_D per episode, when given)

    N = G floor(min(max_concurrent_episodes, G n_adm) / G)

with ``n_adm`` the groups admission lets run at once (``admission_inflight_groups``; a
group's episodes start together, so ``N`` counts whole groups). The sequences decoding at once
follow from Little's law over the decoding sequences, ``b = X k m t(b)``: with the ``N`` open
episodes binding (``X = N / (k m t(b) + e)``) ``b_N`` is the positive root of

    k m c b^2 + (k m a + e - N k m c) b - N k m a = 0      (c = 0: b_N = N k m a / (k m a + e))

and at a rate ``X`` set by another ceiling ``b = X k m a / (1 - X k m c)``; both at most ``kv_slots``.
The steady state is

    X = min(X_L, X_S, X_E, X_N, X_D),   steps/s = p X / (B G)

(``X_N`` the only ceiling that depends on ``b``, and it falls as ``b`` grows, so when another ceiling
binds the smaller ``b`` there only raises ``X_N``: the order holds) and the component whose ceiling is least *binds first* (``N``'s ceiling is named
``admission`` or ``max_concurrent_episodes``, whichever is smaller). Invariants (tested):

- flow balance: ``steps/s x B x G / p == X``;
- utilisations in [0, 1]: learner busy ``= steps/s x D``, learner idle ``= 1 - steps/s x D``,
  sampler busy ``= b / kv_slots`` (``= X k m / R`` when ``c = 0``), env busy ``= X e / env_slots``;
- Little's law over the open episodes: the producer keeps ``N`` episodes open whenever
  admission and ``max_concurrent_episodes`` are its only gates, so an episode is open for
  ``N / X >= T`` seconds (``T`` when the in-flight cap binds; more when episodes queue at the
  sampler or the env, or wait in the buffer for a busy learner);
- staleness: a trained episode's first token is about ``N / X`` seconds older than its step,
  so its mean staleness is about ``steps/s x N / X = p N / (B G)``: groups open per batch,
  times the keep rate. Admission holds each prediction to ``max_staleness`` for episodes that
  take about as long as the others; the discrete-event simulator (``simulate``) gives the
  distribution and its tail.

Admission, modelled as ``harness/pipeline/admission.py`` implements it: a group may start
iff ``v + busy + floor((buffered + kept_upper(n, q)) / B) - s <= S``. In the steady state of
a pipeline run the sampler holds the learner's weights (``s = v``) and the buffer is
drained (``buffered = 0``) whenever the learner waits for data, so the groups admitted at
once are ``1 +`` the largest ``n`` with ``kept_upper(n, q) <= (S + 1 - busy) B - 1``: fewer while the
learner trains (``busy = 1``). ``q`` is the keep rate admission assumes, the Wilson upper
bound over the last ``KEEP_WINDOW`` groups (``admission_keep_rate``), which is above the true
rate ``p``: admission is pessimistic, so fewer groups run than the true rate would allow. The
model takes ``busy = 1`` (the smaller cap) and ``buffered = 0``; the simulator runs the rule itself.
``one_step_off``'s deferred weight update is simulated, not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labrl.errors import ConfigError
from labrl.harness.pipeline.admission import kept_upper, pessimistic_keep_rate
from labrl.harness.pipeline.buffer import KEEP_WINDOW

#: the components whose ceiling may bind, as ``SteadyState.binding`` names them
BINDINGS = ("learner", "sampler", "env_workers", "admission", "max_concurrent_episodes", "driver")


@dataclass(frozen=True)
class Workload:
    """What an episode costs and how often its group is kept (means; the simulator takes distributions)."""

    turns: float
    tokens_per_turn: float
    env_s_per_episode: float  # reset + every step
    keep_rate: float = 1.0

    def __post_init__(self) -> None:
        if self.turns <= 0 or self.tokens_per_turn <= 0 or self.env_s_per_episode < 0:
            raise ConfigError(f"a workload needs turns > 0, tokens_per_turn > 0, env_s >= 0 (got {self})")
        if not 0 < self.keep_rate <= 1:
            raise ConfigError(f"keep_rate must be in (0, 1] (got {self.keep_rate})")

    @property
    def tokens_per_episode(self) -> float:
        return self.turns * self.tokens_per_turn


@dataclass(frozen=True)
class Layout:
    """What runs the workload: sampler, env workers, learner, and the pipeline section's knobs."""

    sampler_tokens_per_s: float  # R: aggregate decode rate with every KV slot busy
    kv_slots: int  # sequences the sampler's KV cache holds at once
    env_slots: int  # env calls that may run at once (env workers x their concurrency)
    learner_step_s: float  # D
    batch_groups: int  # B
    group_size: int  # G
    max_staleness: int  # S (the effective bound: sync 0, one_step_off 1)
    max_concurrent_episodes: int
    # c_D: the driver's CPU seconds per finished episode (collate, buffer, metrics; one process);
    # 0 leaves the driver out
    driver_s_per_episode: float = 0.0
    # c: what each sequence decoding adds to a decode step's seconds (``decode``); 0 the fixed rate
    decode_per_sequence_s: float = 0.0

    def __post_init__(self) -> None:
        if self.sampler_tokens_per_s <= 0 or self.learner_step_s <= 0 or self.driver_s_per_episode < 0:
            raise ConfigError(f"rates and step times must be positive (got {self})")
        if (
            min(
                self.kv_slots,
                self.env_slots,
                self.batch_groups,
                self.group_size,
                self.max_concurrent_episodes,
            )
            < 1
        ):
            raise ConfigError(
                f"slots, batch_groups, group_size and max_concurrent_episodes must be >= 1 (got {self})"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0 (got {self.max_staleness})")
        # a = kv / R - c kv >= 0 (to rounding): c kv alone may not make a full step slower than kv / R
        if (
            self.decode_per_sequence_s < 0
            or self.decode_per_sequence_s * self.sampler_tokens_per_s > 1 + 1e-9
        ):
            raise ConfigError(
                f"decode_per_sequence_s must be in [0, 1 / sampler_tokens_per_s] (got {self.decode_per_sequence_s})"
            )

    @property
    def decode_fixed_s(self) -> float:
        """``a = kv_slots / R - c kv_slots``: a decode step's seconds that no sequence adds."""
        c, kv = self.decode_per_sequence_s, self.kv_slots
        return max(0.0, kv / self.sampler_tokens_per_s - c * kv)

    def decode_step_s(self, decoding: float) -> float:
        """``t(max(b, 1))`` for ``b`` sequences decoding, ``b`` capped at ``kv_slots`` (a decoding sequence is in
        the batch itself; more wait for a slot). ``c = 0``: ``kv_slots / R = 1 / r`` whatever ``b``."""
        c = self.decode_per_sequence_s
        if c == 0:
            return 1.0 / self.decode_tokens_per_s
        return self.decode_fixed_s + c * min(max(decoding, 1.0), self.kv_slots)

    @property
    def decode_tokens_per_s(self) -> float:
        """``r = R / kv_slots``: one sequence's decode rate when every KV slot is busy."""
        return self.sampler_tokens_per_s / self.kv_slots


def admission_keep_rate(true_keep_rate: float, window: int = KEEP_WINDOW) -> float:
    """The keep rate admission assumes once its window is full of groups kept at ``true_keep_rate``:
    ``pessimistic_keep_rate(round(p x window), window)``."""
    return pessimistic_keep_rate(round(true_keep_rate * window), window)


def admission_inflight_groups(
    max_staleness: int, batch_groups: int, keep_rate: float, *, learner_busy: bool, buffered: int = 0
) -> int:
    """The most groups admission lets run at once with the sampler on the learner's version.

    A group starts when the ``n`` already in flight satisfy
    ``buffered + kept_upper(n, keep_rate) <= (S + 1 - busy) B - 1``; so the most in flight is
    one more than the largest such ``n``, and 0 when even ``n = 0`` fails.
    """
    room = (max_staleness + 1 - int(learner_busy)) * batch_groups - 1 - buffered
    if room < 0:
        return 0
    n = 0
    # kept_upper never decreases in n, so the first n past the room ends the search
    while kept_upper(n + 1, keep_rate) <= room:
        n += 1
    return n + 1


@dataclass(frozen=True)
class SteadyState:
    episodes_per_s: float  # X
    steps_per_s: float
    episode_s: float  # T: one episode's generation and env time, no queueing
    open_episodes: int  # N
    learner_busy: float  # steps/s x D
    sampler_busy: float  # X k m / R
    env_busy: float  # X e / env_slots
    binding: str  # one of BINDINGS: the least ceiling
    ceilings: dict[str, float]  # episodes/s each component allows
    admission_groups: int  # n_adm (learner busy)
    decoding: float  # b: sequences decoding at once
    step_s: float  # t(b): one decode step's seconds in the steady state

    @property
    def sequence_tokens_per_s(self) -> float:
        """One sequence's decode rate in the steady state, ``1 / t(b)``."""
        return 1.0 / self.step_s

    @property
    def learner_idle(self) -> float:
        return 1.0 - self.learner_busy

    @property
    def open_s(self) -> float:
        """``N / X``: how long an episode is open, start to training (Little's law)."""
        return self.open_episodes / self.episodes_per_s

    @property
    def staleness_mean(self) -> float:
        """``steps/s x N / X``: the steps taken while an episode is open."""
        return self.steps_per_s * self.open_s


def steady_state(workload: Workload, layout: Layout) -> SteadyState:
    """The closed form of the module docstring."""
    w, lay = workload, layout
    G, B, p = lay.group_size, lay.batch_groups, w.keep_rate
    km, e = w.tokens_per_episode, w.env_s_per_episode
    n_adm = admission_inflight_groups(lay.max_staleness, B, admission_keep_rate(p), learner_busy=True)
    if lay.max_staleness == 0:
        # sync admits only while the learner is idle, a batch at a time: the busy cap would be 0
        n_adm = admission_inflight_groups(0, B, 1.0, learner_busy=False)
    caps = {"max_concurrent_episodes": lay.max_concurrent_episodes, "admission": G * n_adm}
    cap_name = min(caps, key=lambda k: caps[k])
    N = G * (caps[cap_name] // G)
    b_open = decoding_when_open_bind(N, km, e, lay)
    ceilings = {
        "learner": B * G / (p * lay.learner_step_s),
        "sampler": lay.sampler_tokens_per_s / km,
        "env_workers": lay.env_slots / e if e > 0 else math.inf,
        cap_name: N / (km * lay.decode_step_s(b_open) + e),
    }
    if lay.driver_s_per_episode > 0:
        ceilings["driver"] = 1.0 / lay.driver_s_per_episode
    binding = min(ceilings, key=lambda k: ceilings[k])
    X = ceilings[binding]
    b = b_open if binding == cap_name else decoding_at_rate(X, km, lay)
    if lay.max_staleness == 0:  # sync: generate a batch, then train it; the two never overlap
        sync = sync_steps_per_s(w, lay) * B * G / p
        if sync < X:
            X, binding = sync, "admission"
            b = sync_decoding(lay)
    step_s = lay.decode_step_s(b)
    steps = p * X / (B * G)
    return SteadyState(
        episodes_per_s=X,
        steps_per_s=steps,
        episode_s=km * step_s + e,
        open_episodes=N,
        learner_busy=steps * lay.learner_step_s,
        sampler_busy=X * km * step_s / lay.kv_slots,
        env_busy=X * e / lay.env_slots,
        binding=binding,
        ceilings=ceilings,
        admission_groups=n_adm,
        decoding=b,
        step_s=step_s,
    )


def decoding_when_open_bind(open_episodes: int, tokens: float, env_s: float, layout: Layout) -> float:
    """``b_N``: the sequences decoding at once when ``N`` open episodes set the rate, each decoding
    ``k m t(b)`` of its ``k m t(b) + e`` seconds; the positive root of the module docstring's quadratic,
    at most ``kv_slots``."""
    N, km, e = open_episodes, tokens, env_s
    a, c = layout.decode_fixed_s, layout.decode_per_sequence_s
    if c == 0:
        b = N * km / (km + e * layout.decode_tokens_per_s)  # N k m a / (k m a + e), a = 1 / r
    else:
        A, Bq = km * c, km * a + e - N * km * c
        b = (-Bq + math.sqrt(Bq * Bq + 4 * A * N * km * a)) / (2 * A)
    return min(b, float(layout.kv_slots))


def decoding_at_rate(episodes_per_s: float, tokens: float, layout: Layout) -> float:
    """``b = X k m t(b)`` solved for ``b``: ``X k m a / (1 - X k m c)``, at most ``kv_slots`` (all of them
    when ``X k m c >= 1``: the sampler cannot keep up below a full batch)."""
    load = episodes_per_s * tokens
    a, c = layout.decode_fixed_s, layout.decode_per_sequence_s
    if c == 0:
        return min(load / layout.decode_tokens_per_s, float(layout.kv_slots))
    if load * c >= 1:
        return float(layout.kv_slots)
    return min(load * a / (1 - load * c), float(layout.kv_slots))


def sync_decoding(layout: Layout) -> float:
    """``sync``'s batch decodes together: ``min(kv_slots, B G, max_concurrent_episodes)`` sequences."""
    return float(
        min(layout.kv_slots, layout.batch_groups * layout.group_size, layout.max_concurrent_episodes)
    )


def sync_steps_per_s(workload: Workload, layout: Layout) -> float:
    """``sync`` with deterministic times and the whole batch in flight at once: one round per ``T + D``
    (generate the batch, then train it); with keep rate ``p`` a batch takes ``1 / p`` rounds on average.
    ``T = k m t(b) + e`` with the batch decoding together (``sync_decoding``)."""
    T = workload.tokens_per_episode * layout.decode_step_s(sync_decoding(layout)) + workload.env_s_per_episode
    return workload.keep_rate / (T + layout.learner_step_s)
