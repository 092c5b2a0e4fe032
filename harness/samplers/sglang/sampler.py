"""SGLangSampler: the ``Sampler`` protocol over one or more SGLang HTTP servers.

Generation: one ``POST /generate`` per request (``input_ids``, log-probs of
the output tokens, optionally routed experts), routed to a server by the
pool (``pool.py``). A request the server aborts (``finish_reason
abort``: a pause in ``abort`` mode, an ``/abort_request``, a restart) is
resumed from its token prefix: re-submitted with the generated tokens
appended to the prompt and ``max_new_tokens`` reduced, and the pieces are
stitched with the version each token was generated under.

Routed experts and retract/resume: a server recomputes the whole prefix
when a request resumes (``retract`` frees its KV cache; an aborted request
is re-submitted), so the routing of the prefix changes with the weights.
The client keeps, for the whole sequence, the rows of the run that produced
the last token (every row of the final ``/generate`` answer, asked from row
0): the routing under which the final KV cache was built, never old prefix
rows stitched to new ones.

In-flight weight update (``update_weights``)::

    pause_generation(mode)                      retract | in_place | abort
    begin_weight_update                         0.5.23+, distributed transport only
    update_weights_from_disk                    transport "disk": HF checkpoint dir
      | init_weights_update_group (once)        transport "distributed": HF tensors broadcast
        + update_weights_from_distributed x N     from this process (rank 0), one call per
                                                  bucket of <= bucket_mb; the last one carries
                                                  weight_version and flush_cache
    end_weight_update                           0.5.23+, distributed transport only
    continue_generation

Both transports move the same tensors: ``hf_export.hf_weights`` (HF names
and layout, training dtype). The update group is rebuilt (destroyed on both
ends, then initialised again) when a server's process changed since the
group was built (a restart: new ``/server_info`` start time or pid, or a
failed update).

Errors (all ``SamplerError``)::

    transport error / 5xx  -> health check; dead server out of the pool; request retried elsewhere
    4xx                    -> raised at once with the server's message (a bug: retrying won't help),
                              except SGLang's context-length refusal: the sampler learns the
                              length, clamps max_new_tokens to it, and a prompt with no room left
                              finishes ``abort`` (no tokens) with ``info["error"]``
    routed experts asked for but absent -> raised: the server lacks --enable-return-routed-experts
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.errors import ConfigError, SamplerError
from labrl.harness.samplers.sglang.dist import plan_buckets
from labrl.harness.samplers.sglang.pool import RoutingPolicy, ServerPool, ServerState
from labrl.harness.samplers.sglang.wire import (
    decode_segment,
    generate_payload,
    parse_weight_version,
    reshape_routed_rows,
    sampling_params_payload,
    to_learner_layout,
)
from labrl.harness.types import FinishReason, GenerateRequest, GenerateResult
from labrl.resilience import Backoff

log = logging.getLogger(__name__)

PauseMode = Literal["retract", "in_place", "abort"]
WeightTransport = Literal["disk", "distributed"]
ExportDtype = Literal["auto", "float32", "bfloat16", "float16"]
CONFIG_PREFIX = "sampler.sglang"  # where the run config keeps this block; errors name keys under it

# Writes a loadable checkpoint (HF layout) of learner weights into a directory.
WeightWriter = Callable[[Mapping[str, torch.Tensor], Path], None]
# Learner weights -> the served model's HF tensors (hf_export.hf_weights bound to the model config).
HFConverter = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.15.post1"`` -> (0, 5, 15); ``"0.5.23rc1"`` -> (0, 5, 23)."""
    parts: list[int] = []
    for piece in version.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


# The fields of SGLangSamplerConfig that describe the served model, which is the trained one.
MODEL_SHAPE_FIELDS = ("num_hidden_layers", "moe_layers", "topk")


def served_model_shape(model_cfg: Any) -> dict[str, Any]:
    """``MODEL_SHAPE_FIELDS`` of a ``MoEModelConfig``: every decoder layer, the MoE layers' indices, top-k."""
    return {
        "num_hidden_layers": model_cfg.num_layers,
        "moe_layers": tuple(model_cfg.moe_layer_indices),
        "topk": model_cfg.moe_router_topk,
    }


class SGLangSamplerConfig(BaseModel):
    """Everything the client needs; no live objects (serialisable). The ``sampler.sglang`` block.

    ``urls`` are the servers. The ``launch_*`` fields say how
    ``labrl serve sglang --run-config RUN.yaml`` starts the server at
    ``urls[0]`` from SGLang's own interpreter (``launch_python``); a server
    started any other way needs none of them. The model-shape fields
    (``num_hidden_layers``, ``moe_layers``, ``topk``) come from the run's
    model: ``with_model(cfg)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    urls: tuple[str, ...] = Field(default=(), description="base URLs, e.g. http://10.0.0.5:30000")
    launch_python: str | None = Field(
        default=None, description="interpreter of SGLang's own environment (labrl serve sglang --run-config)"
    )
    launch_model_path: str | None = Field(default=None, description="HF checkpoint the launched server loads")
    launch_tp_size: int = Field(default=1, ge=1, description="tensor-parallel size of the launched server")
    launch_args: tuple[str, ...] = Field(default=(), description="more sglang.launch_server arguments")
    num_hidden_layers: int | None = Field(
        default=None, ge=1, description="all decoder layers, dense included"
    )
    moe_layers: tuple[int, ...] | None = Field(default=None, description="indices of the MoE layers")
    topk: int | None = Field(default=None, ge=1, description="experts per token (moe_router_topk)")
    routing: RoutingPolicy = "least_loaded"
    group_sep: str = Field(default="/", min_length=1, description="rid = <group key><sep><sample>")
    pause_mode: PauseMode = "retract"
    weight_transport: WeightTransport = "disk"
    export_dir: str | None = Field(default=None, description="where 'disk' updates write checkpoints")
    keep_exports: int = Field(default=2, ge=1, description="checkpoint dirs kept on disk")
    export_dtype: ExportDtype = Field(
        default="auto", description="dtype of served weights; auto = the learner's training dtype"
    )
    # distributed transport: this process is rank 0 of the update group
    master_address: str = "127.0.0.1"
    master_port: int = Field(default=29555, ge=1, le=65535)
    group_name: str = Field(default="labrl_weights", min_length=1)
    group_backend: Literal["nccl", "gloo"] = "nccl"
    group_timeout_s: float = Field(default=1800.0, gt=0, description="rendezvous and each broadcast")
    bucket_mb: float = Field(default=512.0, gt=0, description="max MiB per update_weights_from_distributed")
    # determinism: SGLang ignores sampling_seed unless launched with --enable-deterministic-inference
    deterministic_inference: bool = False
    # time limits (seconds) and limits
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=1800.0, gt=0, description="one /generate call")
    control_timeout_s: float = Field(default=600.0, gt=0, description="pause/update/continue calls")
    # SGLang answers /health_generate itself within its 20 s watchdog (503 when stuck): wait longer
    # than that, so the server's verdict arrives instead of a client timeout racing it.
    health_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=512, ge=1, description="per client (all servers)")
    max_retries: int = Field(default=3, ge=0, description="re-submissions after transport errors")
    retry_backoff_s: float = Field(default=0.5, ge=0)
    max_resumes: int = Field(default=64, ge=0, description="re-submissions after aborts")

    @model_validator(mode="after")
    def _check(self) -> SGLangSamplerConfig:
        key = f"{CONFIG_PREFIX}."
        if not self.urls:
            raise ConfigError(f"{key}urls is empty: give the server URLs (e.g. [http://127.0.0.1:30000])")
        if self.moe_layers is not None and self.num_hidden_layers is not None:
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ConfigError(
                    f"{key}moe_layers {bad} outside [0, num_hidden_layers={self.num_hidden_layers}): "
                    "list the MoE layer indices of the served model"
                )
            if len(set(self.moe_layers)) != len(self.moe_layers):
                raise ConfigError(f"{key}moe_layers {list(self.moe_layers)} has duplicates")
        if self.weight_transport == "disk" and self.export_dir is None:
            raise ConfigError(
                "weight_transport 'disk' requires export_dir (sampler.sglang.export_dir in a run config): "
                "where each weight update's checkpoint is written"
            )
        return self

    @property
    def server_urls(self) -> tuple[str, ...]:
        return self.urls

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))

    def with_model(self, cfg: Any) -> SGLangSamplerConfig:
        """Fill the model-shape fields from a ``MoEModelConfig`` (the served model is the trained one)."""
        return self.model_copy(update=served_model_shape(cfg))

    def torch_export_dtype(self) -> torch.dtype | None:
        return None if self.export_dtype == "auto" else getattr(torch, self.export_dtype)


class SGLangSampler:
    """Async client for SGLang servers; see the module docstring for the protocol."""

    def __init__(
        self,
        config: SGLangSamplerConfig,
        *,
        weight_writer: WeightWriter | None = None,
        broadcaster: Any | None = None,
        to_hf: HFConverter | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        key = f"{CONFIG_PREFIX}."
        missing = [k for k in ("num_hidden_layers", "moe_layers", "topk") if getattr(config, k) is None]
        if missing:
            raise ConfigError(
                f"{key}{missing[0]} is not set: build the sampler config with .with_model(model_config)"
            )
        if config.weight_transport == "disk" and weight_writer is None:
            raise ConfigError(
                f"{key}weight_transport 'disk' needs a weight_writer (labrl.harness.models.hf_export.export_hf_checkpoint)"
            )
        if config.weight_transport == "distributed" and (broadcaster is None or to_hf is None):
            raise ConfigError(
                f"{key}weight_transport 'distributed' needs a broadcaster "
                "(labrl.harness.samplers.sglang.dist.WeightBroadcaster) and to_hf "
                "(labrl.harness.models.hf_export.hf_weights bound to the model config)"
            )
        self.config = config
        self._writer = weight_writer
        self._broadcaster = broadcaster
        self._to_hf = to_hf
        self._pool = ServerPool(list(config.server_urls), config.routing, config.group_sep)
        limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=64)
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self._client = httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport)
        self._version = 0
        self._server_version: dict[str, int] = {}
        self._running = asyncio.Event()  # set = generation may proceed (not paused by us)
        self._running.set()
        self._update_lock = asyncio.Lock()
        self._exports: list[Path] = []
        self._started = False
        self._submissions = 0  # with _rid_tag, makes every /generate rid unique on the server
        self._context_length: int | None = None  # learnt from the first context-length refusal
        # unique across processes and hosts: two samplers (e.g. train and eval) may share a server
        self._rid_tag = f"{os.getpid():x}{uuid.uuid4().hex[:10]}"
        self._group_servers: dict[str, int] = {}  # url -> rank offset in the current update group
        self._active = 0  # requests in flight through generate()
        self._busy_mark = 0.0
        # busy_s: wall time with at least one request in flight (the pipeline's "sampler busy")
        self.stats = {
            "resumed": 0,
            "retried": 0,
            "inexact_versions": 0,
            "busy_s": 0.0,
            "groups_built": 0,
            "buckets_sent": 0,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def servers(self) -> list[ServerState]:
        return self._pool.servers

    async def start(self) -> None:
        """Read each server's release, flags and weight version; fail early on a misfit."""
        infos = await asyncio.gather(*(self._probe(s) for s in self._pool.servers))
        versions = {info for info in infos}
        if len(versions) > 1:
            raise SamplerError(f"servers disagree on the weight version at start: {sorted(versions)}")
        self._version = versions.pop()
        self._started = True

    async def _probe(self, server: ServerState) -> int:
        info = await self._get(server, "/server_info")
        release = str(info.get("version", ""))
        if not release:
            raise SamplerError(f"{server.url}/server_info has no 'version': is this an SGLang server?")
        server.version = release
        server.info = info
        server.has_weight_update_session = _version_tuple(release) >= (0, 5, 23)
        server.has_routed_experts_start_len = server.has_weight_update_session
        server.routed_experts_enabled = bool(info.get("enable_return_routed_experts", False))
        if self.config.deterministic_inference and not info.get("enable_deterministic_inference"):
            raise SamplerError(
                f"{server.url}: {CONFIG_PREFIX}.deterministic_inference is on but the server runs "
                "without --enable-deterministic-inference (SGLang then ignores sampling_seed): "
                "relaunch it with that flag (labrl serve sglang --deterministic adds it)"
            )
        server.world_size = int(info.get("tp_size", 1)) * int(info.get("pp_size", 1))
        model_info = await self._get(server, "/model_info")
        version = parse_weight_version(model_info.get("weight_version"))
        self._server_version[server.url] = version
        return version

    async def close(self) -> None:
        if self._group_servers:
            await self._destroy_group(self._pool.alive)
        await self._client.aclose()

    async def __aenter__(self) -> SGLangSampler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- HTTP helpers ------------------------------------------------------------------------

    async def _request(
        self, server: ServerState, method: str, path: str, body: dict | None, timeout: float
    ) -> dict:
        try:
            resp = await self._client.request(method, server.url + path, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise _TransportFailure(f"{server.url}{path}: timed out after {timeout} s") from exc
        except httpx.TransportError as exc:
            raise _TransportFailure(f"{server.url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise _TransportFailure(f"{server.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code == 400:
            limit = context_length_in(resp.text)
            if limit is not None:
                raise _ContextFull(limit, f"{server.url}{path}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise SamplerError(
                f"{server.url}{path} rejected the request: HTTP {resp.status_code}: {resp.text[:500]}"
            )
        if not resp.content:
            return {}
        try:
            data = resp.json()
        except ValueError:
            return {"text": resp.text}
        return data if isinstance(data, dict) else {"value": data}

    async def _get(self, server: ServerState, path: str) -> dict:
        try:
            return await self._request(server, "GET", path, None, self.config.control_timeout_s)
        except _TransportFailure as exc:
            raise SamplerError(str(exc)) from exc

    async def _control(self, server: ServerState, path: str, body: dict) -> dict:
        try:
            data = await self._request(server, "POST", path, body, self.config.control_timeout_s)
        except _TransportFailure as exc:
            raise SamplerError(str(exc)) from exc
        if data.get("success") is False:
            raise SamplerError(f"{server.url}{path} failed: {data.get('message', data)}")
        return data

    async def check_health(self, server: ServerState) -> bool:
        """``GET /health_generate`` (runs one token through the model); False takes the server out."""
        try:
            resp = await self._client.get(
                server.url + "/health_generate", timeout=self.config.health_timeout_s
            )
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok and server.alive:
            log.warning("SGLang server %s failed its health check: taken out of the pool", server.url)
            self._pool.mark_dead(server)
        return ok

    # -- generation --------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if not self._started:
            await self.start()
        self._account_busy(len(requests))
        try:
            return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))
        finally:
            self._account_busy(-len(requests))

    def _account_busy(self, change: int) -> None:
        # Counted at every call boundary, so a server that never idles still shows its time.
        now = time.perf_counter()
        if self._active > 0:
            self.stats["busy_s"] += now - self._busy_mark
        self._busy_mark = now
        self._active += change

    async def _generate_one(self, req: GenerateRequest) -> GenerateResult:
        cfg = self.config
        prompt = list(req.input_ids)
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        rows: np.ndarray | None = None  # (tokens fed in, num_hidden_layers, topk) of the latest run
        finish: FinishReason = "abort"
        resumes = retries = 0
        servers_used: list[str] = []
        inexact = False
        failed: set[str] = set()
        context_note = None
        while True:
            remaining = req.sampling.max_new_tokens - len(out_ids)
            if self._context_length is not None:  # SGLang refuses input + max_new_tokens >= context
                room = self._context_length - len(prompt) - len(out_ids) - 1
                if room <= 0:
                    context_note = (
                        f"prompt of {len(prompt) + len(out_ids)} tokens leaves no room in the context "
                        f"of {self._context_length}"
                    )
                    finish = "length" if out_ids else "abort"
                    break
                remaining = min(remaining, room)
            if remaining <= 0:
                finish = "length"
                break
            await self._running.wait()
            server = self._pool.pick(req.rid, frozenset(failed))
            want_rows = req.return_routed_experts
            if want_rows and not server.routed_experts_enabled:
                raise SamplerError(
                    f"{server.url}: routed experts requested but the server runs without "
                    "--enable-return-routed-experts (labrl serve sglang adds it)"
                )
            # SGLang keys live requests by rid: two callers may reuse one (a task sampled twice).
            self._submissions += 1
            body = generate_payload(
                rid=f"{req.rid}#{self._rid_tag}-{self._submissions}",
                input_ids=prompt + out_ids,
                sampling_params=sampling_params_payload(req.sampling, max_new_tokens=remaining),
                return_routed_experts=want_rows,
                # every row, from row 0: a resumed run re-prefills (re-routes) the whole prefix
                routed_experts_start_len=None,
            )
            submitted = self._server_version.get(server.url, self._version)
            server.in_flight += 1
            try:
                answer = await self._request(server, "POST", "/generate", body, cfg.request_timeout_s)
            except _ContextFull as exc:
                if self._context_length == exc.context_length:  # already clamped to it: not a context issue
                    raise SamplerError(str(exc)) from exc
                self._context_length = exc.context_length  # learnt once; the loop clamps from now on
                continue
            except _TransportFailure as exc:
                retries += 1
                self.stats["retried"] += 1
                if not await self.check_health(server):
                    failed.add(server.url)
                if retries > cfg.max_retries:
                    raise SamplerError(
                        f"request {req.rid}: gave up after {cfg.max_retries} retries: {exc}"
                    ) from exc
                await asyncio.sleep(Backoff(cfg.retry_backoff_s).delay(retries - 1))
                continue
            finally:
                server.in_flight -= 1
            seg = decode_segment(
                answer, submitted_version=submitted, want_routed_experts=want_rows, server=server.url
            )
            servers_used.append(server.url)
            inexact |= not seg.exact_versions
            if seg.routed_rows is not None:
                fed = len(prompt) + len(out_ids) + len(seg.output_ids) - 1  # tokens fed in by now
                # this run's rows replace all earlier ones (see module docstring)
                rows = reshape_routed_rows(
                    seg.routed_rows,
                    rows=max(0, fed),
                    num_hidden_layers=cfg.num_hidden_layers,
                    topk=cfg.topk,
                    server=server.url,
                )
            out_ids += seg.output_ids
            logprobs += seg.logprobs
            versions += seg.versions
            if seg.finish_reason != "abort":
                finish = seg.finish_reason
                break
            resumes += 1
            self.stats["resumed"] += 1
            if resumes > cfg.max_resumes:
                raise SamplerError(
                    f"request {req.rid}: aborted {resumes} times (last: {seg.finish_message!r}); "
                    f"max_resumes={cfg.max_resumes}"
                )
        if inexact:
            self.stats["inexact_versions"] += 1
        routed = None
        if req.return_routed_experts and (rows is not None or out_ids):
            all_rows = rows if rows is not None else np.zeros((0, cfg.num_hidden_layers, cfg.topk), np.int32)
            routed = to_learner_layout(
                all_rows, num_tokens=len(prompt) + len(out_ids), moe_layers=cfg.moe_layers
            )
        info: dict[str, Any] = {
            "servers": servers_used,
            "resumes": resumes,
            "retries": retries,
            "exact_versions": not inexact,
        }
        if context_note is not None:
            info["error"] = context_note
        return GenerateResult(
            rid=req.rid,
            output_ids=out_ids,
            logprobs_T=logprobs,
            versions_T=versions,
            finish_reason=finish,
            routed_experts_T_L_K=routed,
            info=info,
        )

    # -- pause / resume / weights --------------------------------------------------------------

    async def _broadcast_control(self, path: str, body: dict) -> None:
        await asyncio.gather(*(self._control(s, path, body) for s in self._pool.alive))

    async def pause(self) -> None:
        """Stop generation on every server; in ``abort`` mode running requests return and resume later."""
        self._running.clear()
        await self._broadcast_control("/pause_generation", {"mode": self.config.pause_mode})

    async def resume(self) -> None:
        await self._broadcast_control("/continue_generation", {})
        self._running.set()

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *, force: bool = False
    ) -> None:
        """Move ``weights`` to every live server as ``version``, in flight (see module docstring).

        Versions must increase, except with ``force=True``: the start of a run
        (or a resume) sets the servers to the learner's weights and version,
        whatever a long-lived server held before.
        """
        if not self._started:
            await self.start()
        if version <= self._version and not force:
            raise SamplerError(f"weight version must increase: have {self._version}, got {version}")
        async with self._update_lock:
            was_running = self._running.is_set()
            if was_running:
                await self.pause()
            try:
                if self.config.weight_transport == "disk":
                    await self._update_from_disk(weights, version)
                else:
                    await self._update_distributed(weights, version)
            finally:
                if was_running:
                    await self.resume()
            self._version = version

    def _flush_cache(self) -> bool:
        # in_place keeps the paused requests' KV cache: flushing it is refused by the server.
        return self.config.pause_mode != "in_place"

    async def _update_from_disk(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        assert self._writer is not None and self.config.export_dir is not None
        path = Path(self.config.export_dir) / f"v{version:06d}"
        await asyncio.to_thread(self._writer, weights, path)
        body = {
            "model_path": str(path),
            "weight_version": str(version),
            "flush_cache": self._flush_cache(),
            "abort_all_requests": False,
        }
        await self._on_all(lambda s: self._control(s, "/update_weights_from_disk", body), version)
        self._exports.append(path)
        while len(self._exports) > self.config.keep_exports:
            await asyncio.to_thread(shutil.rmtree, self._exports.pop(0), True)

    async def _on_all(self, call: Callable[[ServerState], Any], version: int) -> None:
        servers = self._pool.alive
        results = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
        errors = []
        for server, res in zip(servers, results, strict=True):
            if isinstance(res, BaseException):
                # A server that missed an update serves stale weights under a wrong tag: take it out.
                self._pool.mark_dead(server)
                errors.append(f"{server.url}: {res}")
            else:
                self._server_version[server.url] = version
        if errors:
            raise SamplerError(
                f"weight update to version {version} failed (servers taken out): {'; '.join(errors)}"
            )

    async def _update_distributed(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        assert self._broadcaster is not None and self._to_hf is not None
        cfg = self.config
        tensors = await asyncio.to_thread(self._to_hf, weights)
        names = list(tensors)
        buckets = plan_buckets(
            [tensors[n].numel() * tensors[n].element_size() for n in names], cfg.bucket_bytes
        )
        servers = self._pool.alive
        if await self._group_lost(servers):
            await self._build_group(servers)
        session = [s for s in servers if s.has_weight_update_session]
        await asyncio.gather(*(self._control(s, "/begin_weight_update", {}) for s in session))
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            part = [names[j] for j in bucket]
            body: dict[str, Any] = {
                "names": part,
                "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in part],
                "shapes": [list(tensors[n].shape) for n in part],
                "group_name": cfg.group_name,
                # the cache holds KV of the old weights: flushed once, after the last bucket
                "flush_cache": last and self._flush_cache(),
            }
            if last:
                body["weight_version"] = str(version)
            await self._send_bucket(servers, body, [tensors[n] for n in part], version if last else None)
            self.stats["buckets_sent"] += 1
        await asyncio.gather(*(self._control(s, "/end_weight_update", {}) for s in session))

    async def _send_bucket(
        self, servers: list[ServerState], body: dict, tensors: list[torch.Tensor], version: int | None
    ) -> None:
        """One ``/update_weights_from_distributed`` per server while this process broadcasts the bucket."""
        assert self._broadcaster is not None
        send = asyncio.create_task(asyncio.to_thread(self._broadcaster.broadcast, tensors))
        calls = await asyncio.gather(
            *(self._control(s, "/update_weights_from_distributed", body) for s in servers),
            return_exceptions=True,
        )
        errors = []
        for server, res in zip(servers, calls, strict=True):
            if isinstance(res, BaseException):
                self._pool.mark_dead(server)  # it may hold a partial update: out until restarted
                errors.append(f"{server.url}: {res}")
            elif version is not None:
                self._server_version[server.url] = version
        if errors:
            self._group_servers = {}  # the group is broken: rebuilt before the next update
            # A server that refused the call never receives: don't wait out the group timeout here.
            await asyncio.wait({send}, timeout=5.0)
            raise SamplerError(f"distributed weight update failed (servers taken out): {'; '.join(errors)}")
        await send

    async def _group_lost(self, servers: list[ServerState]) -> bool:
        """True when the group must be (re)built: never built, other servers, or a server restarted.

        A restarted server answers with the weight version it was launched
        with, not the one labrl set last; its process holds no group (and
        SGLang asserts on an update to an unknown group), so the whole group
        is rebuilt.
        """
        if set(self._group_servers) != {s.url for s in servers}:
            return True
        infos = await asyncio.gather(*(self._get(s, "/model_info") for s in servers))
        for server, info in zip(servers, infos, strict=True):
            held = parse_weight_version(info.get("weight_version"))
            if held != self._server_version.get(server.url):
                log.warning(
                    "SGLang server %s holds weight version %s, expected %s: restarted? rebuilding the "
                    "weight-update group",
                    server.url,
                    held,
                    self._server_version.get(server.url),
                )
                return True
        return False

    async def _destroy_group(self, servers: list[ServerState]) -> None:
        """Both ends drop the group. Every server is asked: a long-lived one may still hold a group of
        this name from an earlier run, and SGLang refuses to create a group under a name in use."""
        assert self._broadcaster is not None
        body = {"group_name": self.config.group_name}
        # a server without one (restarted, or never joined) answers HTTP 400 "does not exist": fine
        await asyncio.gather(
            *(self._control(s, "/destroy_weights_update_group", body) for s in servers),
            return_exceptions=True,
        )
        await asyncio.to_thread(self._broadcaster.destroy)
        self._group_servers = {}

    async def _build_group(self, servers: list[ServerState]) -> None:
        """Destroy the old group on every end that has one, then rendezvous all ends again."""
        assert self._broadcaster is not None
        cfg = self.config
        await self._destroy_group(servers)
        world = 1 + sum(s.world_size for s in servers)
        offsets, offset = [], 1
        for s in servers:
            offsets.append(offset)
            offset += s.world_size

        def body(rank_offset: int) -> dict:
            return {
                "master_address": cfg.master_address,
                "master_port": cfg.master_port,
                "rank_offset": rank_offset,
                "world_size": world,
                "group_name": cfg.group_name,
                "backend": cfg.group_backend,
            }

        join = asyncio.to_thread(
            self._broadcaster.init_group,
            master_address=cfg.master_address,
            master_port=cfg.master_port,
            world_size=world,
            group_name=cfg.group_name,
            backend=cfg.group_backend,
            timeout_s=cfg.group_timeout_s,
        )
        calls = [
            self._control(s, "/init_weights_update_group", body(o))
            for s, o in zip(servers, offsets, strict=True)
        ]
        results = await asyncio.gather(join, *calls, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise SamplerError(
                    f"init_weights_update_group failed (group {cfg.group_name!r} at "
                    f"{cfg.master_address}:{cfg.master_port}, world {world}): {res}"
                ) from res
        self._group_servers = {s.url: o for s, o in zip(servers, offsets, strict=True)}
        self.stats["groups_built"] += 1


_CONTEXT_LIMIT = re.compile(
    r"longer than the model's context length \((\d+) tokens\)|maximum context length of (\d+) tokens"
)


def context_length_in(message: str) -> int | None:
    """The context length named by SGLang's refusal of an over-long request, or None for other errors."""
    found = _CONTEXT_LIMIT.search(message)
    return None if found is None else int(found.group(1) or found.group(2))


class _ContextFull(SamplerError):
    """Internal: the server refused a request past its context length (HTTP 400); it names the length."""

    def __init__(self, context_length: int, message: str) -> None:
        super().__init__(message)
        self.context_length = context_length


class _TransportFailure(Exception):
    """Internal: a call failed in a way worth a health check and a retry elsewhere."""


def make_sglang_sampler(
    config: SGLangSamplerConfig,
    model_cfg: Any,
    *,
    broadcaster: Any | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> SGLangSampler:
    """The sampler ``labrl train`` runs for ``sampler.kind: sglang`` (the ``sampler.sglang`` block).

    Binds the one megatron -> HF conversion (``hf_export.hf_weights``) to the
    run's model for both transports: the disk writer exports it as a
    checkpoint, the distributed transport broadcasts it. The caller then
    ``start()``s the sampler and pushes the learner's weights with
    ``update_weights(..., force=True)``.
    """
    from labrl.harness.models.hf_export import export_hf_checkpoint, hf_weights
    from labrl.harness.samplers.sglang.dist import WeightBroadcaster

    config = config.with_model(model_cfg)
    dtype = config.torch_export_dtype()
    if config.weight_transport == "disk":
        return SGLangSampler(
            config,
            weight_writer=lambda state, path: export_hf_checkpoint(state, model_cfg, path, dtype=dtype),
            transport=transport,
        )
    return SGLangSampler(
        config,
        broadcaster=broadcaster or WeightBroadcaster(),
        to_hf=lambda state: hf_weights(state, model_cfg, dtype=dtype),
        transport=transport,
    )
