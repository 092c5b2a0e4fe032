"""LocalSampler: batched generation with a megatron-core MoE model, in process, on CPU or CUDA.

It runs the same ``GPTModel`` class the learner trains (its own copy of the
weights, fp32 or bf16), so in fp32 its log-probs match the learner's to float
rounding, and in bf16 the inference/training mismatch is real.

How a batch runs (static batching with megatron-core's KV cache,
``StaticInferenceContext``):

- concurrent ``generate`` calls queue their requests; after ``batch_wait_s``
  up to ``max_batch_size`` of them form one batch;
- prompts are left-padded to a common length P and the pad keys masked out.
  Position embeddings are RoPE, so attention scores depend only on relative
  positions: the shift caused by left padding changes no score;
- one prefill over ``[B, P]``, then one decode step per token over ``[B, 1]``
  against the cache. Each forward runs in a worker thread and the event loop
  gets control back between steps;
- ``update_weights`` takes the model lock between two decode steps: running
  sequences keep their KV cache and continue under the new weights from the
  next token on (SGLang's ``pause_generation(mode="in_place")``). Each token
  records the version of the weights whose forward produced its logits;
- routing is recorded with megatron-core's RouterReplay ``RECORD`` action.
  The result covers prompt and output tokens ``[P_i + N_i, L, K]`` in the
  layout an SGLang server returns after the client pads the last row: the
  last sampled token is never fed back, so its row is padding (experts
  ``0..K-1``; it influences no trained log-prob).

Device: the model lives on ``config.device`` (``auto``: CUDA when available)
in ``config.precision`` (``auto``: bf16 on CUDA from 100M parameters, else fp32). Per forward
there are at most three host-device copies, whatever the batch size: the
fed tokens (and, at an admission, the mask) up, the last-token logits down
(sampling runs on the host with each request's own generator, so seeded
requests draw the same tokens on every device), the recorded routing down.

Behaviour log-prob of a token = log softmax(logits / temperature) at that
token (temperature 0 -> 1), before top-k/top-p truncation; the learner uses
the same temperature.

``engine="static"`` runs the same model through ``static_decode.StaticDecodeEngine``
instead: static shapes, sampling on the device, one host sync per
``finish_check_steps`` decode steps, CUDA graphs where ``device.decode_graphs``
allows. It serves batches in waves (no admission into a running batch), keeps the
same version-per-token and routing contracts, and draws its tokens from
``device_sampling``'s counter-based noise, not the host generators (a seed gives
other tokens than under the megatron engine; what it guarantees is said there).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from labrl.errors import SamplerError
from labrl.harness.models import device as dev
from labrl.harness.models.build import build_gpt_model
from labrl.harness.models.config import MoEModelConfig, ParallelConfig
from labrl.harness.models.device import DEVICE_PATTERN, HOST, PrecisionChoice
from labrl.harness.models.routing import from_megatron_layout, model_router_replays
from labrl.harness.samplers.device_sampling import truncation_mask
from labrl.harness.samplers.static_batch import StaticShape, needs_truncation, pack, row_end, static_shape
from labrl.harness.samplers.static_decode import StaticDecodeEngine, check_supported
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams


class LocalSamplerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    precision: PrecisionChoice = Field(
        default="auto",
        description="auto (bf16 on CUDA for models of 100M parameters or more, else fp32) | fp32 | bf16",
    )
    device: str = Field(
        default="auto", pattern=DEVICE_PATTERN, description="auto (CUDA when available) | cpu | cuda[:N]"
    )
    max_batch_size: int = Field(default=64, ge=1)
    batch_wait_s: float = Field(default=0.005, ge=0.0, description="window to gather concurrent requests")
    seed: int = Field(default=0, description="init seed of the weights and of unseeded sampling")
    pad_token_id: int = Field(default=0, ge=0)
    scheduling: Literal["continuous", "waves"] = Field(
        default="continuous",
        description="continuous: admit waiting requests between decode steps; waves: one batch at a time",
    )
    admit_every_steps: int = Field(
        default=4,
        ge=1,
        description="continuous: decode steps between two admissions into a running batch "
        "(each admission costs a prefill and a cache copy)",
    )
    engine: Literal["megatron", "static"] = Field(
        default="megatron",
        description="megatron: megatron-core's KV cache, host sampling; static: static-shape decode steps "
        "on the device, CUDA graphs where device.decode_graphs allows (served in waves; docs/gpu.md)",
    )
    cuda_graphs: bool = Field(default=True, description="static engine: capture decode steps (false: eager)")
    batch_buckets: tuple[int, ...] = Field(
        default=(1, 8, 32, 64, 128, 256),
        description="static engine: batch sizes with an engine (and graphs) of their own; a batch runs "
        "in the smallest that holds it",
    )
    finish_check_steps: int = Field(
        default=8,
        ge=1,
        description="static engine: decode steps between two reads of the rows' done flags (one host sync each)",
    )

    @field_validator("batch_buckets")
    @classmethod
    def _positive_sorted(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"batch_buckets={sizes}: give one or more sizes >= 1")
        return tuple(sorted(set(sizes)))


@dataclass
class _Pending:
    request: GenerateRequest
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Row:
    request: GenerateRequest
    max_new: int
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)  # (n, L, K) chunks
    finish: str | None = None
    # continuous batching only
    future: asyncio.Future | None = None
    queued_at: float = 0.0
    admitted_at: float = 0.0
    prefill_s: float = 0.0
    batch_size: int = 0
    version: int = 0  # version of the weights behind the row's pending logits


def sample_token(
    logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Sample one token; return it with its behaviour log-prob (see module docstring)."""
    logits_V = logits_V.float()
    if params.temperature == 0.0:
        logp_V = torch.log_softmax(logits_V, dim=-1)
        token = int(torch.argmax(logits_V))
        return token, float(logp_V[token])
    logp_V = torch.log_softmax(logits_V / params.temperature, dim=-1)
    filtered = logp_V
    if (params.top_k > 0 and params.top_k < logp_V.numel()) or params.top_p < 1.0:
        keep = truncation_mask(  # the static engine's rule, one row
            logp_V[None],
            torch.tensor([params.top_k], dtype=torch.long, device=HOST),
            torch.tensor([params.top_p], dtype=torch.float32, device=HOST),
        )[0]
        filtered = logp_V.masked_fill(~keep, -float("inf"))
    probs = torch.softmax(filtered, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp_V[token])


class LocalSampler:
    """In-process sampler implementing ``labrl.harness.types.Sampler``; see the module docstring."""

    def __init__(
        self,
        model_config: MoEModelConfig,
        config: LocalSamplerConfig | None = None,
        parallel: ParallelConfig | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        version: int = 0,
    ) -> None:
        self.model_config = model_config
        self.config = config or LocalSamplerConfig()
        self.device = dev.resolve_device(self.config.device, dev.detect_capabilities())
        self.dtype = dev.param_dtype(
            self.config.precision, self.device, parameters=model_config.parameter_count
        )
        self.model = build_gpt_model(
            model_config,
            parallel,
            seed=self.config.seed,
            routing_replay=True,
            device=self.device,
            dtype=self.dtype,
            # the static engine runs the experts through TorchGroupedMLP's stacked weights
            experts="grouped_mm" if self.config.engine == "static" else "auto",
        ).eval()
        self._static: StaticDecodeEngine | None = None  # the static engine of the last batch shape
        if self.config.engine == "static":
            check_supported(self.model)  # refuse a model it cannot run now, not at the first batch
        self._replays = model_router_replays(self.model)
        self._param_names = {k for k in self.model.state_dict() if not k.endswith("_extra_state")}
        self._lock = threading.Lock()  # one forward or one weight load at a time
        self._version = version
        self._paused = False
        self.waiting_on_pause = False  # True while a batch sits at a step boundary, paused
        self.decode_steps = 0  # decode forwards run since construction
        self._pending: list[_Pending] = []
        self._runner: asyncio.Task | None = None
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self.stats = {"generated_tokens": 0, "batches": 0, "busy_s": 0.0, "cache_merges": 0}
        if weights is not None:
            self._load(weights, version)

    # -- Sampler protocol ----------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        loop = asyncio.get_running_loop()
        items = [_Pending(r, loop.create_future()) for r in requests]
        for item in items:
            self._validate(item.request)
        self._pending.extend(items)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._drain())
        return list(await asyncio.gather(*(i.future for i in items)))

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *, force: bool = False
    ) -> None:
        # an in-process sampler accepts any version, so ``force`` changes nothing here
        await asyncio.to_thread(self._load, weights, version)

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    # -- internals -----------------------------------------------------------

    def _validate(self, request: GenerateRequest) -> None:
        vocab = self.model_config.vocab_size
        if not request.input_ids:
            raise SamplerError(f"request {request.rid}: input_ids is empty")
        bad = [t for t in request.input_ids if not 0 <= t < vocab]
        if bad:
            raise SamplerError(
                f"request {request.rid}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )

    def _load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        missing = self._param_names - set(weights)
        unexpected = set(weights) - self._param_names
        if missing or unexpected:
            raise SamplerError(
                f"weights do not fit the sampler's model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        state = self.model.state_dict()
        with self._lock, torch.no_grad():
            for name, tensor in weights.items():
                target = state[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise SamplerError(
                        f"weight {name} has shape {tuple(tensor.shape)}, the sampler expects {tuple(target.shape)}"
                    )
                target.copy_(tensor)  # casts to the sampler's precision
            self._version = version

    async def _wait_if_paused(self) -> None:
        while self._paused:
            self.waiting_on_pause = True
            await asyncio.sleep(0.005)
        self.waiting_on_pause = False

    async def _drain(self) -> None:
        if self.config.scheduling == "continuous" and self.config.engine == "megatron":
            await self._serve_continuous()
            return
        run = self._run_static_batch if self.config.engine == "static" else self._run_batch
        while self._pending:
            await asyncio.sleep(self.config.batch_wait_s)
            await self._wait_if_paused()
            batch = self._pending[: self.config.max_batch_size]
            del self._pending[: len(batch)]
            try:
                results = await run([p.request for p in batch])
            except BaseException as exc:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(
                            exc
                            if isinstance(exc, SamplerError)
                            else SamplerError(f"generation failed: {exc!r}")
                        )
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for p, result in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(result)

    def _forward(self, ids_B_S: torch.Tensor, mask: torch.Tensor, ctx, record: bool):
        """One forward under the lock: (last-token logits (B, V), version, routing (B, S, L, K) | None).

        ``ids_B_S`` are host tokens (copied up here); ``mask`` is on the model's
        device already. Logits and routing come back on the host.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        B, S = ids_B_S.shape
        offset = ctx.sequence_len_offset
        ids_B_S = ids_B_S.to(self.device)
        positions = torch.arange(offset, offset + S, device=self.device).expand(B, S)
        with self._lock, torch.no_grad():
            for r in self._replays:
                r.clear_indices()
                if record:
                    r.set_router_replay_action(RouterReplayAction.RECORD)
                else:
                    r.clear_router_replay_action()
            logits = self.model(
                input_ids=ids_B_S,
                position_ids=positions,
                attention_mask=mask,
                inference_context=ctx,
                runtime_gather_output=True,
            )
            version = self._version
            routed = None
            if record:
                routed = from_megatron_layout([r.get_recorded_indices() for r in self._replays], B).cpu()
            for r in self._replays:
                r.clear_router_replay_action()
                r.clear_indices()
        ctx.sequence_len_offset += S
        return logits[:, -1, :].float().cpu(), version, routed

    async def _run_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        from megatron.core.inference.contexts import StaticInferenceContext

        started = time.perf_counter()
        max_len = self.model_config.max_sequence_length
        B = len(requests)
        P = max(len(r.input_ids) for r in requests)
        rows: list[_Row] = []
        for r in requests:
            seed = r.sampling.seed
            gen = self._generator if seed is None else torch.Generator().manual_seed(seed)
            max_new = min(r.sampling.max_new_tokens, max_len - len(r.input_ids))
            rows.append(_Row(request=r, max_new=max_new, generator=gen))
            if max_new <= 0:
                rows[-1].finish = "abort"
        N = max(1, max(row.max_new for row in rows))
        record = any(r.return_routed_experts for r in requests)
        ids = torch.full((B, P), self.config.pad_token_id, dtype=torch.long, device=HOST)
        valid = torch.zeros(B, P + N, dtype=torch.bool, device=HOST)  # key positions a row may attend to
        for b, r in enumerate(requests):
            n = len(r.input_ids)
            ids[b, P - n :] = torch.tensor(r.input_ids, dtype=torch.long, device=HOST)
            valid[b, P - n :] = True
        valid[:, P:] = True
        valid = valid.to(self.device)  # once per batch: every decode mask is a slice of it
        ctx = StaticInferenceContext(B, P + N)
        causal = torch.triu(torch.ones(P, P, dtype=torch.bool, device=self.device), diagonal=1)
        prefill_mask = causal[None, None] | ~valid[:, None, None, :P]  # (B, 1, P, P)
        logits, version, routed = await asyncio.to_thread(self._forward, ids, prefill_mask, ctx, record)
        if routed is not None:
            for b, r in enumerate(requests):
                rows[b].routed.append(routed[b, P - len(r.input_ids) :].numpy().astype(np.int32))
        prefill_s = time.perf_counter() - started
        step = 0
        while True:
            fed = torch.full((B, 1), self.config.pad_token_id, dtype=torch.long, device=HOST)
            for b, row in enumerate(rows):
                if row.finish is not None:
                    continue
                token, logprob = sample_token(logits[b], row.request.sampling, row.generator)
                row.output.append(token)
                row.logprobs.append(logprob)
                row.versions.append(version)
                fed[b, 0] = token
                if token in row.request.sampling.stop_token_ids:
                    row.finish = "stop"
                elif len(row.output) >= row.max_new:
                    row.finish = "length"
            live = [row.finish is None for row in rows]
            if not any(live):
                break
            await asyncio.sleep(0)  # let other coroutines (weight updates, envs) run
            await self._wait_if_paused()
            decode_mask = ~valid[:, None, None, : P + step + 1]  # (B, 1, 1, S)
            logits, version, routed = await asyncio.to_thread(self._forward, fed, decode_mask, ctx, record)
            if routed is not None:
                for b, row in enumerate(rows):
                    if live[b]:
                        row.routed.append(routed[b].numpy().astype(np.int32))
            step += 1
            self.decode_steps += 1
        elapsed = time.perf_counter() - started
        self.stats["generated_tokens"] += sum(len(row.output) for row in rows)
        self.stats["batches"] += 1
        self.stats["busy_s"] += elapsed
        return [
            self._result(row, {"batch_size": B, "prefill_s": prefill_s, "generate_s": elapsed})
            for row in rows
        ]

    # -- the static engine -------------------------------------------------------

    async def _run_static_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """One wave on ``StaticDecodeEngine``: prefill, then decode steps in chunks of
        ``finish_check_steps`` (each chunk one worker-thread hop and one read of the done flags).

        Each step takes the model lock, so a weight update lands between two steps; the host
        records the version of every forward, token ``j`` carrying that of the forward behind
        its logits (the prefill for ``j = 0``, decode step ``j - 1`` after). Unseeded requests
        get a seed drawn from the sampler's generator (``device_sampling``: what a seed guarantees).
        """
        started = time.perf_counter()
        max_len = self.model_config.max_sequence_length
        rows = [
            _Row(
                request=r,
                max_new=min(r.sampling.max_new_tokens, max_len - len(r.input_ids)),
                generator=self._generator,
            )
            for r in requests
        ]
        live = [row for row in rows if row.max_new > 0]
        for row in rows:
            if row.max_new <= 0:
                row.finish = "abort"
        prefill_s = 0.0
        if live:
            reqs = [row.request for row in live]
            max_new = [row.max_new for row in live]
            seeds = [self._row_seed(r) for r in reqs]
            shape = static_shape(reqs, max_new, self.config.batch_buckets, max_len)
            host = pack(reqs, max_new, seeds, shape, self.config.pad_token_id)
            engine = await asyncio.to_thread(self._static_engine, shape)
            versions = [await asyncio.to_thread(self._static_prefill, engine, host)]
            prefill_s = time.perf_counter() - started
            truncate, steps = needs_truncation(reqs), 0
            while steps < shape.steps:
                await asyncio.sleep(0)  # let other coroutines (weight updates, envs) run
                await self._wait_if_paused()
                chunk = min(self.config.finish_check_steps, shape.steps - steps)
                done, chunk_versions = await asyncio.to_thread(self._static_steps, engine, chunk, truncate)
                versions += chunk_versions
                steps += chunk
                self.decode_steps += chunk
                if done:
                    break
            record = any(r.return_routed_experts for r in reqs)
            tokens, logprobs, routed = await asyncio.to_thread(
                functools.partial(engine.read_back, steps, shape.prompt, routing=record)
            )
            for b, row in enumerate(live):
                n, row.finish = row_end(tokens[b].tolist(), row.max_new, row.request.sampling.stop_token_ids)
                row.output = tokens[b, :n].tolist()
                row.logprobs = logprobs[b, :n].tolist()
                row.versions = versions[:n]
                if routed is not None and row.request.return_routed_experts:
                    first = shape.prompt - len(row.request.input_ids)
                    # prompt slots and the n - 1 fed tokens; ``_result`` pads the never-fed last one
                    row.routed = [routed[b, first : shape.prompt + n - 1].numpy().astype(np.int32)]
        elapsed = time.perf_counter() - started
        self.stats["generated_tokens"] += sum(len(row.output) for row in rows)
        self.stats["batches"] += 1
        self.stats["busy_s"] += elapsed
        info = {"batch_size": len(requests), "prefill_s": prefill_s, "generate_s": elapsed}
        return [self._result(row, dict(info)) for row in rows]

    def _row_seed(self, request: GenerateRequest) -> int:
        if request.sampling.seed is not None:
            return request.sampling.seed
        return int(torch.randint(0, 2**62, (1,), generator=self._generator, device=HOST))

    def _static_engine(self, shape: StaticShape) -> StaticDecodeEngine:
        """The engine for ``shape``: the last one when its shape matches, else a new one (the old one's
        cache and graphs are freed first: one engine's memory at a time)."""
        key = (shape.batch, shape.capacity, shape.stop_width)
        engine = self._static
        if engine is not None and (engine.B, engine.C, engine.stop_ids.shape[1]) == key:
            return engine
        self._static = None
        graphs, _ = dev.decode_graphs(
            self.device, dev.detect_capabilities(), self.dtype, disabled=not self.config.cuda_graphs
        )
        with self._lock:  # graph capture must not overlap a weight copy
            self._static = StaticDecodeEngine(
                self.model,
                batch_size=shape.batch,
                capacity=shape.capacity,
                stop_width=shape.stop_width,
                graphs=graphs,
            )
        return self._static

    def _static_prefill(self, engine: StaticDecodeEngine, host: dict[str, torch.Tensor]) -> int:
        with self._lock:
            engine.start_batch(**host)
            return self._version

    def _static_steps(self, engine: StaticDecodeEngine, steps: int, truncate: bool) -> tuple[bool, list[int]]:
        """``steps`` decode steps, the lock taken per step; (every row done?, each forward's version)."""
        versions = []
        for _ in range(steps):
            with self._lock, torch.no_grad():
                engine.step(truncate)
                versions.append(self._version)
        return engine.all_done(), versions

    def _result(self, row: _Row, info: dict) -> GenerateResult:
        K = self.model_config.moe_router_topk
        L = self.model_config.num_moe_layers
        routed_arr = None
        if row.request.return_routed_experts:
            pad = np.tile(np.arange(K, dtype=np.int32), (1, L, 1))  # (1, L, K): the never-fed last token
            chunks = [*row.routed, pad] if row.output else row.routed
            # an aborted row (no room in the context) may never have been prefilled: no routing
            routed_arr = np.concatenate(chunks, axis=0) if chunks else None
        if row.finish == "abort":
            info["error"] = (
                f"prompt of {len(row.request.input_ids)} tokens leaves no room in the context of "
                f"{self.model_config.max_sequence_length}"
            )
        return GenerateResult(
            rid=row.request.rid,
            output_ids=row.output,
            logprobs_T=row.logprobs,
            versions_T=row.versions,
            finish_reason=row.finish,  # type: ignore[arg-type]
            routed_experts_T_L_K=routed_arr,
            info=info,
        )

    # -- continuous batching ---------------------------------------------------

    def _new_row(self, item: _Pending, now: float) -> _Row:
        r = item.request
        seed = r.sampling.seed
        gen = self._generator if seed is None else torch.Generator().manual_seed(seed)
        max_new = min(r.sampling.max_new_tokens, self.model_config.max_sequence_length - len(r.input_ids))
        row = _Row(request=r, max_new=max_new, generator=gen, future=item.future, queued_at=item.queued_at)
        row.admitted_at = now
        if max_new <= 0:
            row.finish = "abort"
        return row

    def _finish_row(self, row: _Row) -> None:
        now = time.perf_counter()
        self.stats["generated_tokens"] += len(row.output)
        info = {
            "batch_size": row.batch_size,
            "prefill_s": row.prefill_s,
            "generate_s": now - row.admitted_at,
            "queue_s": row.admitted_at - row.queued_at,
        }
        assert row.future is not None
        if not row.future.done():
            row.future.set_result(self._result(row, info))

    async def _serve_continuous(self) -> None:
        """Continuous batching over one KV cache; see ``_admit`` and ``_compact``.

        Between two decode steps: rows that finished are answered at once,
        waiting requests are prefilled and join the running batch (up to
        ``max_batch_size`` live rows), and the cache drops finished rows when
        they are at least half of it. Every live row advances one token per
        decode forward, whatever step it joined at.
        """
        rows: list[_Row] = []  # cache row order; finished rows stay until compaction
        state: _CacheState | None = None
        taken: list[asyncio.Future] = []  # futures of requests taken off the queue
        busy_since: float | None = None
        admitted_at_step = self.decode_steps
        while self._pending or rows:
            try:
                live = [row for row in rows if row.finish is None]
                if not live:
                    rows, state = [], None
                due = not live or self.decode_steps - admitted_at_step >= self.config.admit_every_steps
                if self._pending and len(live) < self.config.max_batch_size and due:
                    if not live:
                        await asyncio.sleep(self.config.batch_wait_s)  # gather the first wave
                    await self._wait_if_paused()
                    take = self._pending[: self.config.max_batch_size - len(live)]
                    del self._pending[: len(take)]
                    taken = [f for f in taken if not f.done()] + [p.future for p in take]
                    now = time.perf_counter()
                    busy_since = busy_since or now
                    new_rows = [self._new_row(p, now) for p in take]
                    for row in new_rows:
                        if row.finish is not None:
                            self._finish_row(row)
                    new_rows = [row for row in new_rows if row.finish is None]
                    if new_rows:
                        rows, state = await self._admit(rows, state, new_rows)
                        admitted_at_step = self.decode_steps
                        self.stats["batches"] += 1
                if not any(row.finish is None for row in rows):
                    if busy_since is not None:
                        self.stats["busy_s"] += time.perf_counter() - busy_since
                        busy_since = None
                    continue
                assert state is not None
                fed = torch.full((len(rows), 1), self.config.pad_token_id, dtype=torch.long, device=HOST)
                for b, row in enumerate(rows):
                    if row.finish is not None:
                        continue
                    token, logprob = sample_token(state.logits_B_V[b], row.request.sampling, row.generator)
                    row.output.append(token)
                    row.logprobs.append(logprob)
                    row.versions.append(row.version)
                    fed[b, 0] = token
                    if token in row.request.sampling.stop_token_ids:
                        row.finish = "stop"
                    elif len(row.output) >= row.max_new:
                        row.finish = "length"
                    if row.finish is not None:
                        self._finish_row(row)
                live_idx = [b for b, row in enumerate(rows) if row.finish is None]
                if not live_idx:
                    continue
                if 2 * (len(rows) - len(live_idx)) >= len(rows):
                    # finished rows are at least half the batch: drop them from the cache
                    state = await asyncio.to_thread(_merge_caches, [(state, live_idx)], _room(rows))
                    self.stats["cache_merges"] += 1
                    rows, fed = [rows[b] for b in live_idx], fed[live_idx]
                await asyncio.sleep(0)  # let other coroutines (weight updates, envs) run
                await self._wait_if_paused()
                ctx = state.ctx
                S = ctx.sequence_len_offset + 1
                start_dev = state.start_on(self.device)
                decode_mask = (torch.arange(S, device=self.device)[None] < start_dev[:, None])[
                    :, None, None, :
                ]  # (B, 1, 1, S)
                record = any(row.request.return_routed_experts for row in rows if row.finish is None)
                logits, version, routed = await asyncio.to_thread(
                    self._forward, fed, decode_mask, ctx, record
                )
                state.logits_B_V = logits
                for b, row in enumerate(rows):
                    if row.finish is None:
                        row.version = version
                        if routed is not None and row.request.return_routed_experts:
                            row.routed.append(routed[b].numpy().astype(np.int32))
                self.decode_steps += 1
                if busy_since is not None:
                    now = time.perf_counter()
                    self.stats["busy_s"] += now - busy_since
                    busy_since = now
            except BaseException as exc:
                # the running batch fails; queued requests are served afterwards
                for fut in taken:
                    if not fut.done():
                        fut.set_exception(
                            exc
                            if isinstance(exc, SamplerError)
                            else SamplerError(f"generation failed: {exc!r}")
                        )
                rows, state, taken = [], None, []
                if isinstance(exc, asyncio.CancelledError):
                    for p in self._pending:
                        if not p.future.done():
                            p.future.set_exception(SamplerError(f"generation failed: {exc!r}"))
                    self._pending.clear()
                    raise

    async def _admit(
        self, rows: list[_Row], state: _CacheState | None, new_rows: list[_Row]
    ) -> tuple[list[_Row], _CacheState]:
        """Prefill ``new_rows`` (left-padded) in a cache of their own, then merge it with the running one."""
        from megatron.core.inference.contexts import StaticInferenceContext

        started = time.perf_counter()
        B = len(new_rows)
        P = max(len(row.request.input_ids) for row in new_rows)
        room = _room([*rows, *new_rows])
        ids = torch.full((B, P), self.config.pad_token_id, dtype=torch.long, device=HOST)
        start = torch.empty(B, dtype=torch.long, device=HOST)
        for b, row in enumerate(new_rows):
            n = len(row.request.input_ids)
            ids[b, P - n :] = torch.tensor(row.request.input_ids, dtype=torch.long, device=HOST)
            start[b] = P - n
        # alone, the prefill cache is the running cache: room for every new token; otherwise only the prompts
        ctx = StaticInferenceContext(B, P + (room if state is None else 0))
        keys = torch.arange(P, device=HOST)  # the mask is built on the host and copied up with the ids
        blocked = (keys[None, :] > keys[:, None])[None] | (keys[None, :] < start[:, None])[:, None, :]
        record = any(row.request.return_routed_experts for row in new_rows)
        mask = blocked[:, None].to(self.device)
        logits, version, routed = await asyncio.to_thread(self._forward, ids, mask, ctx, record)
        prefill_s = time.perf_counter() - started
        for b, row in enumerate(new_rows):
            row.version = version
            row.prefill_s = prefill_s
            if routed is not None and row.request.return_routed_experts:
                row.routed.append(routed[b, int(start[b]) :].numpy().astype(np.int32))
        fresh = _CacheState(ctx=ctx, start_B=start, logits_B_V=logits)
        if state is None:
            merged, all_rows = fresh, new_rows
        else:
            live_idx = [b for b, row in enumerate(rows) if row.finish is None]
            merged = await asyncio.to_thread(
                _merge_caches, [(state, live_idx), (fresh, list(range(B)))], room
            )
            all_rows = [rows[b] for b in live_idx] + new_rows
        for row in all_rows:
            row.batch_size = max(row.batch_size, len(all_rows))
        return all_rows, merged


@dataclass
class _CacheState:
    """A running batch's KV cache: row ``b`` attends to key slots ``[start_B[b], ctx.sequence_len_offset)``."""

    ctx: object  # megatron StaticInferenceContext
    start_B: torch.Tensor  # (B,) long, host
    logits_B_V: torch.Tensor  # (B, V): next-token logits of each row, host
    _start_on_device: torch.Tensor | None = None

    def start_on(self, device: torch.device) -> torch.Tensor:
        """``start_B`` on the model's device, copied once per cache (decode masks are built there)."""
        if self._start_on_device is None:
            self._start_on_device = self.start_B.to(device)
        return self._start_on_device


def _room(rows: list[_Row]) -> int:
    """Cache slots a batch still needs after its offset: one per token its live rows may yet feed."""
    return 1 + max((row.max_new - len(row.output) for row in rows if row.finish is None), default=0)


def _merge_caches(parts: list[tuple[_CacheState, list[int]]], extra: int) -> _CacheState:
    """Copy the given rows of several caches into one, right-aligned at a common offset.

    megatron-core's static cache stores keys before RoPE and rotates them at
    their slot position on every forward
    (megatron/core/transformer/attention.py: ``_adjust_key_value_for_inference``),
    so moving a row's keys to other slots only shifts absolute positions:
    RoPE attention depends on relative positions alone, the same argument
    that makes left padding exact. The common offset is the longest row
    span, so finished rows and unneeded left padding are dropped; slots
    before a row's start are zeros and masked.
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    spans = [p.ctx.sequence_len_offset - int(p.start_B[idx].min()) for p, idx in parts if idx]
    offset = max(spans)
    B = sum(len(idx) for _, idx in parts)
    ctx = StaticInferenceContext(B, offset + extra)
    ctx.sequence_len_offset = offset
    layers = parts[0][0].ctx.key_value_memory_dict.keys()
    for layer in layers:
        k0, v0 = parts[0][0].ctx.key_value_memory_dict[layer]
        keys = torch.zeros((offset + extra, B, *k0.shape[2:]), dtype=k0.dtype, device=k0.device)
        values = torch.zeros((offset + extra, B, *v0.shape[2:]), dtype=v0.dtype, device=v0.device)
        row = 0
        for p, idx in parts:
            if not idx:
                continue
            k, v = p.ctx.key_value_memory_dict[layer]
            end = p.ctx.sequence_len_offset
            span = end - int(p.start_B[idx].min())
            on_device = torch.tensor(idx, dtype=torch.long, device=k.device)
            keys[offset - span : offset, row : row + len(idx)] = k[end - span : end, on_device]
            values[offset - span : offset, row : row + len(idx)] = v[end - span : end, on_device]
            row += len(idx)
        ctx.key_value_memory_dict[layer] = (keys, values)
    starts, logits = [], []
    for p, idx in parts:
        if idx:
            starts.append(p.start_B[idx] + (offset - p.ctx.sequence_len_offset))
            logits.append(p.logits_B_V[idx])
    return _CacheState(ctx=ctx, start_B=torch.cat(starts), logits_B_V=torch.cat(logits))
