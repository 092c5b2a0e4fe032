"""A discrete-event simulation of the training pipeline: simulated hours in seconds, seeded.

What it simulates, as the orchestrator runs it (``harness/pipeline``):

- a *producer* starts a group of ``G`` episodes whenever ``max_concurrent_episodes``
  has room and admission allows it: the very rule of ``admission.may_start``, with the
  keep rate the orchestrator assumes (``pessimistic_keep_rate`` over the last
  ``KEEP_WINDOW`` verdicts in ``pipeline`` mode, 1 otherwise);
- an *episode* is an env reset, then per turn a generation and an env step. A
  generation of ``m`` tokens holds one of ``kv_slots`` sampler slots (a FIFO queue
  beyond them) until its ``m`` decode steps are done; a step takes ``t(b)`` seconds
  with ``b`` sequences decoding (``Layout.decode_step_s``), so all of them advance at
  ``1 / t(b)`` tokens/s and a sequence finishes sooner in a smaller batch
  (``BatchedDecoder``). With the fixed rate (``c = 0``) that is ``m / r`` seconds on
  one of ``kv_slots`` servers, ``r = R / kv_slots``. An env call holds one of
  ``env_slots`` env slots for a drawn latency (a FIFO ``Station``: c servers, one queue). Its tokens carry the sampler version at its
  first generation;
- a finished episode passes through the *driver* (one server, ``driver_s_per_episode`` s
  each) when the layout gives it a cost;
- a finished *group* is kept with probability ``p`` (dynamic sampling) into the
  buffer; the *learner* takes the ``B`` kept groups that started first
  (``buffer.started_first``), trains for ``learner_step_s`` and bumps the version;
  the sampler takes the new weights at once (``one_step_off``: once no group is
  in flight);
- a trained episode's staleness is the learner's version at the step minus its tokens'
  version, as ``stats.token_staleness`` counts the stalest token.

``SimResult`` reports, over the simulated time after ``warmup_s``: steps/s (between the
first and last step of the window, so a periodic schedule gives its exact rate), the
learner's idle fraction, the staleness histogram with p50 / p99 and the episodes over
``max_staleness``, and time-averaged queue lengths (generations waiting for a KV slot,
env calls waiting for a slot, kept groups in the buffer, groups in flight).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from labrl.harness.metrics import percentile
from labrl.harness.pipeline.admission import AdmissionState, may_start, pessimistic_keep_rate
from labrl.harness.pipeline.buffer import KEEP_WINDOW, Group, started_first
from labrl.harness.pipeline.config import Mode
from labrl.harness.planning.draws import Draw
from labrl.harness.planning.model import Layout, Workload


class EventLoop:
    """A heap of ``(time, sequence, callback)``: callbacks run in time order, ties in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, callback))

    def run(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            self.now, _, callback = heapq.heappop(self._heap)
            callback()
        self.now = until


class TimeAverage:
    """The time average of a quantity that changes in steps, from ``start`` on."""

    def __init__(self, loop: EventLoop, start: float = 0.0) -> None:
        self.loop, self.start = loop, start
        self.value = 0.0
        self._area = 0.0
        self._since = 0.0

    def set(self, value: float) -> None:
        now = self.loop.now
        if now > self.start:
            self._area += self.value * (now - max(self._since, self.start))
        self.value, self._since = value, now

    def mean(self) -> float:
        self.set(self.value)
        span = self.loop.now - self.start
        return self._area / span if span > 0 else self.value


class Station:
    """``servers`` identical servers and one FIFO queue; records each job's wait from ``record_from`` on."""

    def __init__(self, loop: EventLoop, servers: int, *, record_from: float = 0.0) -> None:
        self.loop, self.servers = loop, servers
        self.busy = 0
        self.queue: deque[tuple[float, float, Callable[[], None], Callable[[], None] | None]] = deque()
        self.queue_length = TimeAverage(loop, record_from)
        self.busy_servers = TimeAverage(loop, record_from)
        self.record_from = record_from
        self.waits: list[float] = []

    def submit(
        self, service_s: float, done: Callable[[], None], *, on_start: Callable[[], None] | None = None
    ) -> None:
        """Queue a job of ``service_s`` seconds; ``on_start`` runs when it gets a server, ``done`` when it ends."""
        self.queue.append((self.loop.now, service_s, done, on_start))
        self.queue_length.set(len(self.queue))
        self._dispatch()

    def _dispatch(self) -> None:
        while self.busy < self.servers and self.queue:
            arrived, service_s, done, on_start = self.queue.popleft()
            self.queue_length.set(len(self.queue))
            if on_start is not None:
                on_start()
            if arrived >= self.record_from:
                self.waits.append(self.loop.now - arrived)
            self.busy += 1
            self.busy_servers.set(self.busy)
            self.loop.after(service_s, lambda done=done: self._finish(done))  # type: ignore[misc]

    def utilisation(self) -> float:
        """The time-averaged fraction of the servers busy."""
        return self.busy_servers.mean() / self.servers

    def _finish(self, done: Callable[[], None]) -> None:
        self.busy -= 1
        self.busy_servers.set(self.busy)
        self._dispatch()
        done()


class BatchedDecoder:
    """The sampler as a batched decoder: up to ``layout.kv_slots`` sequences decode together, one FIFO queue.

    Every live sequence advances one token per decode step of ``t(b)`` seconds (``b`` live), so the
    tokens each has decoded since the start, ``V``, grow at ``dV/dt = 1 / t(b)``; a sequence of ``m``
    tokens admitted at ``V0`` finishes when ``V = V0 + m``. The live sequences sit in a heap by that
    finish value, and the next finish is ``(V_min - V) t(b)`` seconds away until ``b`` changes (an
    admission or a finish), when it is scheduled again (the stale event is dropped by its epoch).
    The same records as ``Station``: queue length, busy slots, waits.
    """

    def __init__(self, loop: EventLoop, layout: Layout, *, record_from: float = 0.0) -> None:
        self.loop, self.layout, self.servers = loop, layout, layout.kv_slots
        self.live: list[tuple[float, int, Callable[[], None]]] = []  # (finish V, sequence, done)
        self.queue: deque[tuple[float, float, Callable[[], None], Callable[[], None] | None]] = deque()
        self.queue_length = TimeAverage(loop, record_from)
        self.busy_servers = TimeAverage(loop, record_from)
        self.record_from = record_from
        self.waits: list[float] = []
        self.decoded = 0.0  # V
        self._since = 0.0
        self._epoch = 0
        self._seq = 0

    def submit(
        self, tokens: float, done: Callable[[], None], *, on_start: Callable[[], None] | None = None
    ) -> None:
        """Queue a generation of ``tokens`` tokens; ``on_start`` runs when it gets a slot, ``done`` when it ends."""
        self._advance()
        self.queue.append((self.loop.now, tokens, done, on_start))
        self.queue_length.set(len(self.queue))
        self._dispatch()
        self._schedule()

    def utilisation(self) -> float:
        """The time-averaged fraction of the slots busy."""
        return self.busy_servers.mean() / self.servers

    def _advance(self) -> None:
        now = self.loop.now
        if self.live:
            self.decoded += (now - self._since) / self.layout.decode_step_s(len(self.live))
        self._since = now

    def _dispatch(self) -> None:
        while len(self.live) < self.servers and self.queue:
            arrived, tokens, done, on_start = self.queue.popleft()
            self.queue_length.set(len(self.queue))
            if on_start is not None:
                on_start()
            if arrived >= self.record_from:
                self.waits.append(self.loop.now - arrived)
            self._seq += 1
            heapq.heappush(self.live, (self.decoded + tokens, self._seq, done))
        self.busy_servers.set(len(self.live))

    def _schedule(self) -> None:
        self._epoch += 1
        if self.live:
            left = max(0.0, self.live[0][0] - self.decoded)
            epoch = self._epoch
            self.loop.after(left * self.layout.decode_step_s(len(self.live)), lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        # the head is this event's; others due within rounding finish with it
        finished = [heapq.heappop(self.live)[2]]
        while self.live and self.live[0][0] <= self.decoded * (1 + 1e-12):
            finished.append(heapq.heappop(self.live)[2])
        self._dispatch()
        self._schedule()
        for done in finished:
            done()


@dataclass(frozen=True)
class TracedEpisode:
    """One traced episode's costs as they were: tokens of each turn, env seconds of each call (reset first)."""

    tokens: tuple[float, ...]
    env_s: tuple[float, ...]


@dataclass(frozen=True)
class EpisodeModel:
    """One episode's costs as distributions: turns (rounded, at least 1), tokens per turn, env seconds per call.

    With ``groups`` (traced groups, each its episodes), a simulated group replays one of them
    drawn at random, member ``i`` as its episode ``i mod`` its size: the costs of a group's
    episodes stay as correlated as they were (the members play one task, so an env whose
    latency depends on the task is slow for the whole group; independent draws would make
    every group as slow as the slowest of ``G`` draws). An env call past a traced episode's
    own is drawn from ``env_s``.
    """

    turns: Draw
    tokens_per_turn: Draw
    env_s: Draw  # one env call: a step (and the reset, unless ``reset_s`` is given)
    keep_rate: float = 1.0  # the fraction of finished groups the buffer keeps
    groups: tuple[tuple[TracedEpisode, ...], ...] = ()
    reset_s: Draw | None = None  # the reset's seconds, when they differ from a step's

    @property
    def env_s_per_episode(self) -> float:
        """Mean env seconds of an episode: the reset's mean plus ``turns`` steps of ``env_s``'s mean."""
        reset = self.reset_s.mean if self.reset_s is not None else self.env_s.mean
        return reset + self.turns.mean * self.env_s.mean

    def workload(self) -> Workload:
        """The means the closed form (``model``) takes."""
        return Workload(self.turns.mean, self.tokens_per_turn.mean, self.env_s_per_episode, self.keep_rate)


@dataclass
class SimResult:
    simulated_s: float
    steps: int
    steps_per_s: float
    learner_idle: float
    staleness_hist: dict[int, int]
    staleness_p50: float
    staleness_p99: float
    over_max_staleness: int  # trained episodes staler than the bound
    queues: dict[str, float]  # time-averaged lengths
    utilisation: dict[str, float]  # time-averaged busy fraction of each component
    kv_wait_s: float  # mean wait of a generation for a KV slot
    env_wait_s: float  # mean wait of an env call for a slot
    episodes_started: int = 0
    step_times: list[float] = field(default_factory=list)


class PipelineSim:
    """The pipeline of the module docstring on one ``EventLoop``."""

    def __init__(
        self,
        episode: EpisodeModel,
        layout: Layout,
        *,
        mode: Mode = "pipeline",
        seed: int = 0,
        warmup_s: float = 0.0,
    ) -> None:
        self.episode, self.layout, self.mode = episode, layout, mode
        self.rng = random.Random(seed)
        self.loop = EventLoop()
        self.warmup_s = warmup_s
        # the fixed rate keeps the plain station: its service times are m / r exactly
        self.sampler: Station | BatchedDecoder = (
            BatchedDecoder(self.loop, layout, record_from=warmup_s)
            if layout.decode_per_sequence_s > 0
            else Station(self.loop, layout.kv_slots, record_from=warmup_s)
        )
        self.env = Station(self.loop, layout.env_slots, record_from=warmup_s)
        self.driver = Station(self.loop, 1, record_from=warmup_s)
        self.learner_version = 0
        self.sampler_version = 0
        self.learner_busy = False
        self.update_pending = False  # one_step_off: a new version waits for no group in flight
        self.buffer: list[Group] = []
        self.token_versions: dict[int, list[int]] = {}  # group index -> each episode's token version
        self.recent_kept: deque[bool] = deque(maxlen=KEEP_WINDOW)
        self.inflight_groups = 0
        self.next_index = 0
        self.staleness: Counter[int] = Counter()
        self.step_times: list[float] = []
        self.learner_busy_s = 0.0
        self._step_started = 0.0
        self.buffered = TimeAverage(self.loop, warmup_s)
        self.inflight = TimeAverage(self.loop, warmup_s)

    # -- producer ------------------------------------------------------------------

    def keep_rate_assumed(self) -> float:
        """As ``Orchestrator.keep_rate``: 1 outside ``pipeline``, else the Wilson bound of the recent verdicts."""
        if self.mode != "pipeline":
            return 1.0
        return pessimistic_keep_rate(sum(self.recent_kept), len(self.recent_kept))

    def can_start(self) -> bool:
        lay = self.layout
        if (self.inflight_groups + 1) * lay.group_size > lay.max_concurrent_episodes:
            return False
        state = AdmissionState(
            learner_version=self.learner_version,
            learner_busy=self.learner_busy,
            sampler_version=self.sampler_version,
            buffered_groups=len(self.buffer),
            inflight_groups=self.inflight_groups,
        )
        return may_start(state, lay.batch_groups, self.keep_rate_assumed(), lay.max_staleness)

    def produce(self) -> None:
        while self.can_start():
            self.start_group()

    def start_group(self) -> None:
        index, started = self.next_index, self.loop.now
        self.next_index += 1
        self.inflight_groups += 1
        self.inflight.set(self.inflight_groups)
        group = Group(index, index, [], self.sampler_version, started)
        versions: list[int] = []
        self.token_versions[index] = versions
        remaining = [self.layout.group_size]

        def episode_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.group_finished(group)

        traced = self.rng.choice(self.episode.groups) if self.episode.groups else None
        for i in range(self.layout.group_size):
            self.run_episode(versions, episode_done, traced[i % len(traced)] if traced else None)

    def run_episode(
        self, versions: list[int], done: Callable[[], None], traced: TracedEpisode | None = None
    ) -> None:
        """Reset, then per turn a generation and an env step; ``versions`` gets its tokens' version.
        ``traced``: the turns, tokens and env calls of a traced episode instead of draws."""
        ep, rate = self.episode, self.layout.decode_tokens_per_s
        turns = len(traced.tokens) if traced else max(1, round(ep.turns.sample(self.rng)))

        def tokens(turn_index: int) -> float:
            return traced.tokens[turn_index] if traced else ep.tokens_per_turn.sample(self.rng)

        def env_call(call_index: int) -> float:
            if traced and call_index < len(traced.env_s):
                return traced.env_s[call_index]
            if call_index == 0 and ep.reset_s is not None:
                return ep.reset_s.sample(self.rng)
            return ep.env_s.sample(self.rng)

        def finish() -> None:
            if self.layout.driver_s_per_episode > 0:
                self.driver.submit(self.layout.driver_s_per_episode, done)
            else:
                done()

        def stamp() -> None:
            # the stalest token is the first one made, with the weights the sampler holds when the
            # episode's first generation gets its KV slot
            versions.append(self.sampler_version)

        def turn(left: int) -> None:
            if left == 0:
                finish()
                return
            index = turns - left
            self.sampler.submit(
                tokens(index) if isinstance(self.sampler, BatchedDecoder) else tokens(index) / rate,
                lambda: self.env.submit(env_call(index + 1), lambda: turn(left - 1)),
                on_start=stamp if left == turns else None,
            )

        self.env.submit(env_call(0), lambda: turn(turns))  # the reset

    def group_finished(self, group: Group) -> None:
        self.inflight_groups -= 1
        self.inflight.set(self.inflight_groups)
        kept = self.rng.random() < self.episode.keep_rate
        self.recent_kept.append(kept)
        if kept:
            group.finished_at = self.loop.now
            self.buffer.append(group)
            self.buffered.set(len(self.buffer))
        else:
            del self.token_versions[group.index]
        if self.update_pending and self.inflight_groups == 0:
            self.update_pending = False
            self.sampler_version = self.learner_version
        self.train()
        self.produce()

    # -- learner -------------------------------------------------------------------

    def train(self) -> None:
        B = self.layout.batch_groups
        if self.learner_busy or len(self.buffer) < B:
            return
        self.buffer.sort(key=started_first)
        batch, self.buffer = self.buffer[:B], self.buffer[B:]
        self.buffered.set(len(self.buffer))
        counted = self.loop.now >= self.warmup_s
        for group in batch:
            for version in self.token_versions.pop(group.index):
                if counted:
                    self.staleness[self.learner_version - version] += 1
        self.learner_busy = True
        self._step_started = self.loop.now
        self.loop.after(self.layout.learner_step_s, self.step_done)
        self.produce()  # admission reads learner_busy

    def step_done(self) -> None:
        now = self.loop.now
        if now > self.warmup_s:
            self.learner_busy_s += now - max(self._step_started, self.warmup_s)
        self.learner_busy = False
        self.learner_version += 1
        self.step_times.append(now)
        if self.mode == "one_step_off" and self.inflight_groups > 0:
            self.update_pending = True
        else:
            self.sampler_version = self.learner_version
        self.train()
        self.produce()

    # -- the run -------------------------------------------------------------------

    def run(self, seconds: float) -> SimResult:
        self.loop.after(0.0, self.produce)
        self.loop.run(seconds)
        if self.learner_busy:  # the step in progress at the end counts up to the end
            self.learner_busy_s += seconds - max(self._step_started, self.warmup_s)
        window = [t for t in self.step_times if t >= self.warmup_s]
        rate = (len(window) - 1) / (window[-1] - window[0]) if len(window) >= 2 else 0.0
        span = seconds - self.warmup_s
        values = sorted(self.staleness.elements())
        return SimResult(
            simulated_s=seconds,
            steps=len(self.step_times),
            steps_per_s=rate,
            learner_idle=1.0 - self.learner_busy_s / span if span > 0 else 0.0,
            staleness_hist=dict(sorted(self.staleness.items())),
            staleness_p50=percentile(values, 50),
            staleness_p99=percentile(values, 99),
            over_max_staleness=sum(n for s, n in self.staleness.items() if s > self.layout.max_staleness),
            queues={
                "kv_cache": self.sampler.queue_length.mean(),
                "env": self.env.queue_length.mean(),
                "driver": self.driver.queue_length.mean(),
                "buffer": self.buffered.mean(),
                "groups_in_flight": self.inflight.mean(),
            },
            utilisation={
                "learner": self.learner_busy_s / span if span > 0 else 0.0,
                "sampler": self.sampler.utilisation(),
                "env": self.env.utilisation(),
                "driver": self.driver.utilisation(),
            },
            kv_wait_s=sum(self.sampler.waits) / len(self.sampler.waits) if self.sampler.waits else 0.0,
            env_wait_s=sum(self.env.waits) / len(self.env.waits) if self.env.waits else 0.0,
            episodes_started=self.next_index * self.layout.group_size,
            step_times=self.step_times,
        )


def simulate(
    episode: EpisodeModel,
    layout: Layout,
    *,
    seconds: float,
    mode: Mode = "pipeline",
    seed: int = 0,
    warmup_s: float | None = None,
) -> SimResult:
    """Run ``layout`` for ``seconds`` of simulated time; the first tenth (or ``warmup_s``) is not measured."""
    warm = seconds / 10 if warmup_s is None else warmup_s
    return PipelineSim(episode, layout, mode=mode, seed=seed, warmup_s=warm).run(seconds)
