"""A faithful fake of SGLang's HTTP server for CPU runs and tests.

The endpoints, field names and answer shapes are SGLang's (0.5.23, or 0.5.15
with ``sglang_version="0.5.15"``: no ``/begin_weight_update`` /
``/end_weight_update``, no ``weight_versions`` spans, no
``routed_experts_start_len`` field, which that release ignores like any
unknown top-level field). Generation is delegated to any in-process
``Sampler`` (``LocalSampler`` on the tiny MoE, or a test double), driven one
token per scheduler tick for all running requests, so the server behaves
like a continuous-batching engine: a pause lands between two tokens, a
weight update mid-request makes later tokens carry the new version, and
routed-expert rows are captured as each token is fed in.

Refused like the real server:
- unknown ``sampling_params`` keys (SGLang's ``SamplingParams(**d)`` raises
  TypeError -> HTTP 400 ``{"error": {"message": ...}}``);
- ``routed_experts_start_len`` outside ``[0, prompt_tokens]`` (0.5.23);
- ``/flush_cache`` while requests are running or queued (HTTP 400);
- weight-update calls that fail answer HTTP 400 ``{"success": false, "message"}``
  (``http_server.py``): ``flush_cache=true`` while paused ``in_place``,
  tensor/distributed updates outside ``begin_weight_update`` (0.5.23), a
  group that cannot be joined ("Failed to initialize custom process group: ...").
An update on an unpaused server waits until running requests finish (the
real server's writer lock) and holds new ones back meanwhile.

Where the real server fails silently, so does the fake, and it counts:
- weights load by HF name through ``SGLangStyleWeights`` (SGLang's
  ``load_weights`` mapping); a name the model lacks is skipped, recorded in
  ``server.weights.skipped`` (tests assert it stays empty);
- the update group is SGLang's ``PrefixStore(group_name, TCPStore)``
  rendezvous (``sglang_dist``), joined from a child process: a wrong group
  name times out there too;
- ``retract`` puts running requests back in the queue and, on resume, the
  whole prefix is prefilled again: its routed-expert rows are recomputed
  under the weights held then (the KV cache is rebuilt), as SGLang does;
- ``sampling_seed`` is ignored unless the server runs with
  ``--enable-deterministic-inference`` (``enable_deterministic_inference``).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from labrl.harness.samplers.sglang.wire import SGLANG_SAMPLING_KEYS, encode_routed_experts
from labrl.harness.types import GenerateRequest, Sampler, SamplingParams
from labrl.testing.fake_sglang_weights import SGLangStyleWeights

ServerRelease = Literal["0.5.23", "0.5.15"]
WeightLoader = Callable[[str], Mapping[str, torch.Tensor]]  # checkpoint dir -> backend weights


class FakeServerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sglang_version: ServerRelease = "0.5.23"
    num_hidden_layers: int = Field(ge=1)
    moe_layers: tuple[int, ...] = Field(min_length=1)
    topk: int = Field(ge=1)
    enable_return_routed_experts: bool = True
    weight_version: str = "0"
    model_path: str = "fake-model"
    eos_token_ids: tuple[int, ...] = ()
    tp_size: int = Field(default=1, ge=1)
    tick_delay_s: float = Field(default=0.0, ge=0, description="sleep per token: slows generation for tests")
    context_length: int | None = Field(
        default=None,
        ge=2,
        description="refuse requests past it, as SGLang's TokenizerManager does (None: no limit)",
    )
    enable_deterministic_inference: bool = False
    group_timeout_s: float = Field(default=1800.0, gt=0, description="weight-update group rendezvous")


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: dict[str, Any]
    return_logprob: bool
    return_routed: bool
    start_len: int
    done: asyncio.Future
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)  # (num_hidden_layers, topk) per fed token
    reprefill: bool = False  # retracted: the whole prefix is fed in again on resume


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    """SGLang's answer to weight/group calls: 200 on success, 400 BAD_REQUEST otherwise."""
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


class FakeSGLangServer:
    """Holds the scheduler state; ``self.app`` is the FastAPI application."""

    def __init__(
        self,
        backend: Sampler,
        config: FakeServerConfig,
        *,
        load_weights: WeightLoader | None = None,
        receiver_factory: Callable[[], Any] | None = None,
        weights: SGLangStyleWeights | None = None,
    ) -> None:
        """``weights``: the served model's parameters (``local_fake_server``); updates load into
        them by HF name and the backend generates from ``weights.hf_state()``. Without it (test
        doubles), ``load_weights(path)`` reads disk updates and tensors go to the backend as sent."""
        self.backend = backend
        self.config = config
        self.load_weights = load_weights
        self.receiver_factory = receiver_factory
        self.weights = weights
        self.to_backend: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] = dict
        self.weight_version = config.weight_version
        self.healthy = True
        self.paused: str | None = None  # pause mode while paused
        self.in_update_session = False
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self.log: list[str] = []  # control calls in order, for tests
        self.rids: list[str] = []  # every /generate rid, for tests
        self.received: list[tuple[str, str, tuple[int, ...]]] = []  # (name, dtype, shape) sent to us
        self._receiver: Any = None
        self.group_name: str | None = None
        self._wake: asyncio.Event | None = None
        self._tick_lock: asyncio.Lock | None = None
        self._scheduler: asyncio.Task | None = None
        self._admit = True
        self.app = self._build_app()

    def _set_update_session(self, open_: bool) -> Any:
        """Open (``/begin_weight_update``) or close (``/end_weight_update``) the weight-update
        session of SGLang 0.5.23; opening an open one or closing a closed one fails."""
        if self.in_update_session == open_:
            return _result(
                False,
                "a weight update session is already open" if open_ else "no weight update session is open",
            )
        self.in_update_session = open_
        self.log.append("begin" if open_ else "end")
        return {"success": True, "message": ""}

    # -- scheduler ---------------------------------------------------------------------------

    def _ensure_scheduler(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._wake = asyncio.Event()
            self._tick_lock = asyncio.Lock()
            self._scheduler = asyncio.get_running_loop().create_task(self._run())

    def _poke(self) -> None:
        assert self._wake is not None
        self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None and self._tick_lock is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                async with self._tick_lock:
                    if self._admit:
                        self.running += self.waiting
                        self.waiting = []
                    if self.paused is not None or not self.running:
                        break
                    await self._tick()
                await asyncio.sleep(self.config.tick_delay_s)

    async def _tick(self) -> None:
        batch = list(self.running)
        requests = []
        for r in batch:
            seed = r.params.get("sampling_seed")
            pos = len(r.prompt) + len(r.out)
            requests.append(
                GenerateRequest(
                    rid=f"{r.rid}@{pos}",
                    input_ids=tuple(r.prompt + r.out),
                    sampling=SamplingParams(
                        max_new_tokens=1,
                        temperature=float(r.params.get("temperature", 1.0)),
                        top_p=float(r.params.get("top_p", 1.0)),
                        top_k=int(r.params.get("top_k", -1)),
                        # SGLang ignores sampling_seed without --enable-deterministic-inference
                        seed=None
                        if seed is None or not self.config.enable_deterministic_inference
                        else _derive_seed(int(seed), pos),
                    ),
                    return_routed_experts=r.return_routed,
                )
            )
        try:
            results = await self.backend.generate(requests)
        except Exception as exc:  # the engine crashed: every running request fails like SGLang's do
            for r in batch:
                self._finish(r, {"type": "abort", "message": f"engine error: {exc}"})
            return
        for r, res in zip(batch, results, strict=True):
            if r.done.done():
                continue
            if res.routed_experts_T_L_K is not None:
                moe = res.routed_experts_T_L_K  # (len(input)+1, moe_layers, topk)
                if r.reprefill:  # resumed after a retract: every row is routed again, under today's weights
                    r.rows = []
                    r.reprefill = False
                    fed: Sequence[int] = range(0, len(r.prompt) + len(r.out))
                elif not r.out:
                    fed = range(0, len(r.prompt))
                else:
                    fed = [len(r.prompt) + len(r.out) - 1]
                for pos in fed:
                    row = np.zeros((self.config.num_hidden_layers, self.config.topk), np.int32)
                    row[list(self.config.moe_layers)] = moe[pos]
                    r.rows.append(row)
            if not res.output_ids:
                self._finish(r, {"type": "stop", "matched": None})
                continue
            token = res.output_ids[0]
            r.out.append(token)
            r.logprobs.append(res.logprobs_T[0])
            r.versions.append(self.weight_version)
            stops = set(r.params.get("stop_token_ids") or ())
            if not r.params.get("ignore_eos"):
                stops |= set(self.config.eos_token_ids)
            if token in stops:
                self._finish(r, {"type": "stop", "matched": token})
            elif len(r.out) >= int(r.params.get("max_new_tokens", 128)):
                self._finish(r, {"type": "length", "length": len(r.out)})

    def _finish(self, r: _Req, reason: dict[str, Any]) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        if not r.done.done():
            r.done.set_result(reason)

    # -- responses ---------------------------------------------------------------------------

    def _answer(self, r: _Req, reason: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": reason,
            "prompt_tokens": len(r.prompt),
            "completion_tokens": len(r.out),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.out, strict=True)]
        if self.config.sglang_version == "0.5.23" and r.out:
            spans, start = [], 0
            for i in range(1, len(r.versions) + 1):
                if i == len(r.versions) or r.versions[i] != r.versions[start]:
                    spans.append({"version": r.versions[start], "start": start, "end": i})
                    start = i
            meta["weight_versions"] = spans
        if r.return_routed and self.config.enable_return_routed_experts:
            rows_needed = len(r.prompt) + len(r.out) - 1
            if len(r.rows) >= rows_needed:
                rows = np.stack(r.rows[:rows_needed]) if rows_needed > 0 else self._no_rows()
                meta["routed_experts"] = encode_routed_experts(rows[r.start_len :])
            elif reason["type"] != "abort":
                raise RuntimeError(f"fake server lost routing rows of {r.rid}")
        return {"text": "", "output_ids": list(r.out), "meta_info": meta}

    def _no_rows(self) -> np.ndarray:
        return np.zeros((0, self.config.num_hidden_layers, self.config.topk), np.int32)

    # -- endpoints ---------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="fake SGLang")
        s = self
        v523 = self.config.sglang_version == "0.5.23"

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            s._ensure_scheduler()
            body = await request.json()
            problem = s._validate_generate(body)
            if problem:
                return _error(problem)
            params = dict(body.get("sampling_params") or {})
            s.rids.append(str(body.get("rid")))
            r = _Req(
                rid=str(body.get("rid") or f"req-{id(body)}"),
                prompt=[int(t) for t in body["input_ids"]],
                params=params,
                return_logprob=bool(body.get("return_logprob", False)),
                return_routed=bool(body.get("return_routed_experts", False)),
                start_len=int(body.get("routed_experts_start_len", 0)) if v523 else 0,
                done=asyncio.get_running_loop().create_future(),
            )
            if int(params.get("max_new_tokens", 128)) == 0:
                return s._answer(r, {"type": "length", "length": 0})
            s.waiting.append(r)
            s._poke()
            reason = await r.done
            return s._answer(r, reason)

        @app.post("/pause_generation")
        async def pause_generation(request: Request) -> Any:
            s._ensure_scheduler()
            body = await _json(request)
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                return _error(f"Invalid mode: {mode!r}; expected one of abort, retract, in_place")
            assert s._tick_lock is not None
            async with s._tick_lock:  # takes effect between two scheduler steps
                s.paused = mode
                if mode == "abort":
                    for r in list(s.running) + list(s.waiting):
                        s._finish(r, {"type": "abort", "message": "Abort before the generation is paused."})
                elif mode == "retract":
                    # back to the queue, KV cache freed: the prefix is prefilled again on resume
                    for r in s.running:
                        r.reprefill = True
                    s.waiting = s.running + s.waiting
                    s.running = []
            s.log.append(f"pause:{mode}")
            return {"success": True, "message": f"Generation paused ({mode})."}

        @app.post("/continue_generation")
        async def continue_generation() -> Any:
            s._ensure_scheduler()
            s.paused = None
            s.log.append("continue")
            s._poke()
            return {"success": True, "message": "Generation continued."}

        @app.post("/abort_request")
        async def abort_request(request: Request) -> Any:
            s._ensure_scheduler()
            body = await _json(request)
            for r in list(s.running) + list(s.waiting):
                if body.get("abort_all") or r.rid == body.get("rid"):
                    s._finish(r, {"type": "abort", "message": "Abort by user request."})
            return Response(status_code=200)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache() -> Any:
            if s.running or s.waiting:
                return Response(
                    "Cache not flushed. Please check backend logs for more details. "
                    "(When there are running or waiting requests, the operation will not be performed.)\n",
                    status_code=400,
                )
            return Response("Cache flushed.\n", status_code=200)

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> Any:
            s._ensure_scheduler()
            body = await _json(request)
            refused = await s._before_update(body, num_paused_requests=0)
            if refused:
                return refused
            if s.load_weights is None:
                return _result(False, "this fake server has no weight loader", num_paused_requests=0)
            try:
                weights = await asyncio.to_thread(s.load_weights, str(body["model_path"]))
                if s.weights is not None:
                    weights = await asyncio.to_thread(s._load_named, list(weights.items()))
            except Exception as exc:
                s._admit = True
                return _result(False, f"Failed to update weights: {exc}.", num_paused_requests=0)
            return await s._apply(weights, body, "disk")

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request) -> Any:
            body = await _json(request)
            if s.receiver_factory is None:
                return _result(False, "this fake server cannot join a weight-update group")
            if s._receiver is not None:
                await asyncio.to_thread(s._receiver.destroy)
            s._receiver = s.receiver_factory()
            try:
                await asyncio.to_thread(
                    s._receiver.init_group,
                    master_address=body["master_address"],
                    master_port=int(body["master_port"]),
                    rank=int(body["rank_offset"]),
                    world_size=int(body["world_size"]),
                    group_name=body["group_name"],
                    backend=body.get("backend", "nccl"),
                )
            except Exception as exc:
                s._receiver = None
                return _result(False, f"Failed to initialize custom process group: {exc}.")
            s.group_name = body["group_name"]
            s.log.append("init_group")
            return _result(True, "Succeeded to initialize custom process group.")

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(request: Request) -> Any:
            body = await _json(request)
            if s._receiver is None or body.get("group_name", "weight_update_group") != s.group_name:
                return _result(False, "The group to be destroyed does not exist.")
            receiver, s._receiver = s._receiver, None
            await asyncio.to_thread(receiver.destroy)
            s.log.append("destroy_group")
            return _result(True, "Succeeded to destroy custom process group.")

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request) -> Any:
            s._ensure_scheduler()
            body = await _json(request)
            if v523 and not s.in_update_session:
                return _result(False, "update_weights_from_distributed requires begin_weight_update first")
            group = body.get("group_name", "weight_update_group")
            if s._receiver is None or group != s.group_name:
                # SGLang asserts here (the scheduler dies); the fake answers instead
                held = [s.group_name] if s._receiver is not None else []
                return _result(
                    False, f"Group {group} not in {held}. Please call `init_weights_update_group` first."
                )
            refused = await s._before_update(body)
            if refused:
                return refused
            s.received += [
                (n, d, tuple(shape))
                for n, d, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
            ]
            load = s._load_named if s.weights is not None else dict
            try:
                tensors = await asyncio.to_thread(
                    s._receiver.receive, body["names"], body["dtypes"], body["shapes"], load
                )
            except Exception as exc:
                s._admit = True
                return _result(
                    False,
                    f"Failed to update parameter online: {exc}. The full weights of the ModelRunner "
                    "are partially updated. Please discard the whole weights.",
                )
            return await s._apply(tensors, body, "distributed")

        if v523:

            @app.post("/begin_weight_update")
            async def begin_weight_update() -> Any:
                return s._set_update_session(True)

            @app.post("/end_weight_update")
            async def end_weight_update() -> Any:
                return s._set_update_session(False)

        @app.get("/server_info")
        async def server_info() -> Any:
            return {
                "version": s.config.sglang_version,
                "model_path": s.config.model_path,
                "enable_return_routed_experts": s.config.enable_return_routed_experts,
                "tp_size": s.config.tp_size,
                "enable_deterministic_inference": s.config.enable_deterministic_inference,
                "pp_size": 1,
                "dp_size": 1,
                "weight_version": s.weight_version,
            }

        @app.get("/model_info")
        async def model_info() -> Any:
            return {
                "model_path": s.config.model_path,
                "tokenizer_path": s.config.model_path,
                "is_generation": True,
                "weight_version": s.weight_version,
            }

        @app.get("/health")
        async def health() -> Any:
            return Response(status_code=200 if s.healthy else 503)

        @app.get("/health_generate")
        async def health_generate() -> Any:
            if not s.healthy:
                return Response(status_code=503)
            return Response(status_code=200)

        return app

    def _validate_generate(self, body: Any) -> str | None:
        if not isinstance(body, dict):
            return "request body must be a JSON object"
        ids = body.get("input_ids")
        if ids is None:
            return "Either text or input_ids should be provided (the fake server takes input_ids only)."
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return "input_ids must be a non-empty list of int (batched input is not emulated)"
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - SGLANG_SAMPLING_KEYS)
        if unknown:
            return f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'"
        if int(params.get("max_new_tokens", 128)) < 0:
            return f"max_new_tokens must be at least 0, got {params['max_new_tokens']}."
        problem = self._context_problem(len(ids), params.get("max_new_tokens"))
        if problem:
            return problem
        if float(params.get("temperature", 1.0)) < 0:
            return f"temperature must be non-negative, got {params['temperature']}."
        if self.config.sglang_version == "0.5.23" and "routed_experts_start_len" in body:
            start = body["routed_experts_start_len"]
            if not isinstance(start, int) or not 0 <= start <= len(ids):
                return f"routed_experts_start_len={start!r} must be in [0, prompt_tokens={len(ids)}]"
        return None

    def _context_problem(self, n_input: int, max_new_tokens: Any) -> str | None:
        """SGLang's context check (``TokenizerManager._validate_one_request``), messages verbatim."""
        limit = self.config.context_length
        if limit is None:
            return None
        if n_input >= limit:
            return f"The input ({n_input} tokens) is longer than the model's context length ({limit} tokens)."
        if max_new_tokens is not None and int(max_new_tokens) + n_input >= limit:
            total = int(max_new_tokens) + n_input
            return (
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
                f"You requested a total of {total} tokens: {n_input} tokens from the input messages and "
                f"{int(max_new_tokens)} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit."
            )
        return None

    async def _before_update(self, body: Mapping[str, Any], **answer_extra: Any) -> JSONResponse | None:
        if self.paused == "in_place" and body.get("flush_cache", True) and (self.running or self.waiting):
            return _result(
                False,
                "Cannot flush cache while generation is paused in_place with running requests: "
                "pass flush_cache=false",
                **answer_extra,
            )
        if body.get("abort_all_requests"):
            for r in list(self.running) + list(self.waiting):
                self._finish(r, {"type": "abort", "message": "Abort for weight update."})
        if self.paused is None:
            # writer lock: hold new requests back, let the running ones finish
            self._admit = False
            while self.running:
                await asyncio.sleep(0.005)
        return None

    def _load_named(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """SGLang's ``model.load_weights(named)``; returns the backend's view of all weights held now."""
        assert self.weights is not None
        self.weights.load_weights(named)
        return dict(self.to_backend(self.weights.hf_state()))

    async def _apply(self, weights: Mapping[str, torch.Tensor], body: Mapping[str, Any], how: str) -> Any:
        version = body.get("weight_version")
        try:
            assert self._tick_lock is not None
            async with self._tick_lock:
                new = self.weight_version if version is None else str(version)
                await self.backend.update_weights(weights, int(new) if new.isdigit() else 0)
                self.weight_version = new
        except Exception as exc:
            extra = {"num_paused_requests": 0} if how == "disk" else {}
            return _result(False, f"Failed to update weights: {exc}.", **extra)
        finally:
            self._admit = True
            self._poke()
        self.log.append(f"update_{how}:{self.weight_version}")
        if how == "distributed":
            return _result(True, "Succeeded to update parameter online.")
        return _result(True, "Succeeded to update model weights.", num_paused_requests=0)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    data = await request.json()
    return data if isinstance(data, dict) else {}


def _derive_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


class ServerThread:
    """Runs an ASGI app under uvicorn on 127.0.0.1 in a daemon thread (tests, CPU pipelines).

    ``with ServerThread(app) as url: ...``; ``stop()`` shuts it down (a dead server for tests).
    """

    def __init__(self, app: FastAPI, port: int = 0) -> None:
        import uvicorn

        from labrl.ports import free_port

        if port == 0:
            port = free_port()
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True, name=f"fake-sglang-{port}")

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake SGLang server on port {self.port} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_fake_server(
    model_path: str,
    *,
    sglang_version: ServerRelease = "0.5.23",
    enable_return_routed_experts: bool = True,
    enable_deterministic_inference: bool = False,
    weight_version: str = "0",
    tick_delay_s: float = 0.0,
    group_timeout_s: float = 1800.0,
    seed: int = 0,
    receiver_device: str | None = None,
) -> FakeSGLangServer:
    """A fake server that serves an exported HF checkpoint with ``LocalSampler`` (fp32, CPU).

    Weights live in SGLang's fused layout (``SGLangStyleWeights``); disk and
    distributed updates both load HF-named tensors through its
    ``load_weights``, and the backend generates from what it holds (converted
    with ``hf_import.hf_to_megatron``), so an update that loads nothing
    changes nothing here either. The distributed transport joins a gloo group,
    or an NCCL one receiving on ``receiver_device`` (``sglang_dist.WeightReceiver``). Like SGLang, generation stops at the
    checkpoint's ``eos_token_id`` unless the request sets ``ignore_eos``.
    """
    import json
    from pathlib import Path

    from labrl.harness.models.hf_import import _arch, config_from_hf, hf_to_megatron, load_hf_tensors
    from labrl.harness.samplers.local import LocalSampler, LocalSamplerConfig
    from labrl.harness.samplers.sglang.dist import WeightReceiver

    cfg = config_from_hf(model_path)
    config_json = json.loads((Path(model_path) / "config.json").read_text())
    arch = _arch(config_json)
    eos = config_json.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    version = int(weight_version) if weight_version.isdigit() else 0
    weights = SGLangStyleWeights(cfg, arch, load_hf_tensors(model_path))

    def to_backend(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return hf_to_megatron(hf, cfg, arch)

    backend = LocalSampler(
        cfg, LocalSamplerConfig(seed=seed), weights=to_backend(weights.hf_state()), version=version
    )
    server = FakeSGLangServer(
        backend,
        FakeServerConfig(
            sglang_version=sglang_version,
            num_hidden_layers=cfg.num_layers,
            moe_layers=tuple(cfg.moe_layer_indices),
            topk=cfg.moe_router_topk,
            enable_return_routed_experts=enable_return_routed_experts,
            enable_deterministic_inference=enable_deterministic_inference,
            weight_version=weight_version,
            model_path=model_path,
            eos_token_ids=eos_ids,
            tick_delay_s=tick_delay_s,
            group_timeout_s=group_timeout_s,
        ),
        load_weights=load_hf_tensors,
        receiver_factory=lambda: WeightReceiver(timeout_s=group_timeout_s, device=receiver_device),
        weights=weights,
    )
    server.to_backend = to_backend
    return server


def export_run_model(run_config: str, path: str) -> str:
    """Write a randomly initialised HF checkpoint of a ``labrl train`` config's model to ``path``.

    What a CPU run serves before its first update: the pipeline pushes the
    learner's weights (version 0) at start, so only the architecture matters.
    """
    from labrl.harness.config import load_run_config
    from labrl.harness.models.build import build_gpt_model
    from labrl.harness.models.hf_export import export_hf_checkpoint

    model_cfg = load_run_config(run_config).model.resolve()
    model = build_gpt_model(model_cfg, seed=0)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return str(export_hf_checkpoint(state, model_cfg, path))


def main(argv: list[str] | None = None) -> int:
    """``python -m labrl.testing.fake_sglang_server --model-path CKPT --port N``: SGLang's CLI shape.

    Serves an exported HF checkpoint (``labrl.harness.models.hf_export``) with
    ``LocalSampler`` on CPU, so ``labrl serve sglang --launcher ...`` and the
    ``sampler: sglang`` pipeline run without a GPU. ``--run-config RUN.yaml``
    first writes a random-init checkpoint of that run's model to
    ``--model-path`` (when it holds no ``config.json`` yet).
    """
    import argparse
    from pathlib import Path

    import uvicorn

    p = argparse.ArgumentParser(prog="fake_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--sglang-version", choices=("0.5.23", "0.5.15"), default="0.5.23")
    p.add_argument("--run-config", help="labrl train config whose model to export to --model-path first")
    args, _ignored = p.parse_known_args(argv)  # other SGLang flags (--tp-size, ...) mean nothing here
    if args.run_config and not (Path(args.model_path) / "config.json").exists():
        export_run_model(args.run_config, args.model_path)
    server = local_fake_server(
        args.model_path,
        sglang_version=args.sglang_version,
        enable_return_routed_experts=args.enable_return_routed_experts,
        enable_deterministic_inference=args.enable_deterministic_inference,
        weight_version=args.weight_version,
    )
    uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
