"""A deterministic OpenAI-compatible judge for CI, with fault injection.

``POST /v1/chat/completions`` reads the rubric prompt built by
``labrl.verifiers.rubric.prompt`` (criteria and the delimited response), and
scores each criterion from the response text alone:

    score = 1.0 if every backticked key-term group of the criterion has at least
            one alternative in the response, else 0.0

(``"Names `rutile|TiO2` as ..."``: one group, two alternatives). Matching is
case-insensitive on whole words, after mapping subscript digits to digits and
dashes to ``-``. A criterion without key terms scores 0.0. The answer is the
strict JSON object the client expects, so tests assert real scores.

Faults (``MockJudgeConfig.fault``), applied to the first ``fail_first``
requests (all requests when None), then the judge answers normally:

    garbage       HTTP 200 whose content is prose, not JSON
    out_of_range  valid JSON with every score 1.5
    missing_item  valid JSON that leaves out the last criterion
    http_500      HTTP 500
    http_429      HTTP 429 with Retry-After: 0
    timeout       sleeps ``hang_s`` seconds before answering

Run it in-process with ``httpx.ASGITransport(app=create_app(...))`` (what
``JudgeConfig(base_url="mock://")`` does), on a real socket in a background
thread with ``serve_in_thread()``, or from the CLI with
``labrl judge serve-mock``. ``GET /admin/state`` reports request counts;
``POST /admin/fault`` changes the fault at run time.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from labrl.verifiers.rubric.items import key_term_groups
from labrl.verifiers.rubric.prompt import read_prompt

Fault = Literal["none", "garbage", "out_of_range", "missing_item", "http_500", "http_429", "timeout"]
_SUBSCRIPTS = str.maketrans("₀₁₂₃₄₅₆₇₈₉⁰¹²³⁴⁵⁶⁷⁸⁹‐‑‒–—−", "0123456789" + "0123456789" + "------")


class MockJudgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fault: Fault = "none"
    fail_first: int | None = Field(
        default=None, ge=0, description="faulty requests before healthy ones; None = all"
    )
    hang_s: float = Field(default=30.0, ge=0, description="how long the timeout fault sleeps")
    api_key: str | None = Field(
        default=None, description="when set, require 'Authorization: Bearer <api_key>'"
    )


class MockJudgeState:
    def __init__(self, config: MockJudgeConfig) -> None:
        self.config = config
        self.requests = 0
        self.faults_served = 0
        self.bodies: list[dict[str, Any]] = []  # the last 64 request bodies, for tests


def normalise(text: str) -> str:
    return " ".join(text.translate(_SUBSCRIPTS).casefold().split())


def term_present(term: str, text: str) -> bool:
    """``term`` occurs in ``text`` as whole words (both already ``normalise``d)."""
    return re.search(rf"(?<![0-9a-z]){re.escape(term)}(?![0-9a-z])", text) is not None


def keyword_score(criterion: str, response: str) -> float:
    groups = key_term_groups(criterion)
    if not groups:
        return 0.0
    text = normalise(response)
    return 1.0 if all(any(term_present(normalise(t), text) for t in group) for group in groups) else 0.0


def _completion(model: str, content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def _public(config: MockJudgeConfig) -> dict[str, Any]:
    """The config without the API key (admin endpoints never echo secrets)."""
    return {**config.model_dump(exclude={"api_key"}), "api_key_required": config.api_key is not None}


def create_app(config: MockJudgeConfig | None = None) -> Any:
    """The FastAPI app; its ``state.judge`` is the ``MockJudgeState``."""
    app = FastAPI(title="labrl mock judge")
    state = MockJudgeState(config or MockJudgeConfig())
    app.state.judge = state

    @app.get("/admin/state")
    async def admin_state() -> dict[str, Any]:
        return {
            "requests": state.requests,
            "faults_served": state.faults_served,
            "config": _public(state.config),
        }

    @app.post("/admin/fault")
    async def admin_fault(new: MockJudgeConfig) -> dict[str, Any]:
        state.config = new
        state.faults_served = 0
        return _public(new)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        state.requests += 1
        cfg = state.config
        if cfg.api_key is not None and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        try:
            body = await request.json()
            user = next(m["content"] for m in body["messages"] if m["role"] == "user")
            criteria, response, _question = read_prompt(user)
        except (json.JSONDecodeError, KeyError, TypeError, StopIteration, ValueError) as exc:
            return JSONResponse({"error": {"message": f"not a rubric prompt: {exc}"}}, status_code=400)
        state.bodies = [*state.bodies[-63:], body]
        model = str(body.get("model", "mock"))
        fault = cfg.fault
        if fault != "none" and (cfg.fail_first is None or state.faults_served < cfg.fail_first):
            state.faults_served += 1
            if fault == "http_500":
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            if fault == "http_429":
                return JSONResponse(
                    {"error": {"message": "slow down"}}, status_code=429, headers={"Retry-After": "0"}
                )
            if fault == "timeout":
                await asyncio.sleep(cfg.hang_s)
            if fault == "garbage":
                return _completion(model, "All criteria look fine to me, full marks!")
            scores = [
                {
                    "id": cid,
                    "rationale": "mock",
                    "score": 1.5 if fault == "out_of_range" else keyword_score(t, response),
                }
                for cid, t in criteria
            ]
            if fault == "missing_item":
                scores = scores[:-1]
            return _completion(model, json.dumps({"scores": scores}))
        scores = [
            {
                "id": cid,
                "rationale": "key terms found"
                if (s := keyword_score(text, response))
                else "key terms missing",
                "score": s,
            }
            for cid, text in criteria
        ]
        return _completion(model, json.dumps({"scores": scores}))

    return app


class RunningMockJudge(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_url: str
    app: Any

    @property
    def state(self) -> MockJudgeState:
        return self.app.state.judge


@contextmanager
def serve_in_thread(
    config: MockJudgeConfig | None = None, host: str = "127.0.0.1"
) -> Iterator[RunningMockJudge]:
    """Serve the mock judge with uvicorn on a free loopback port in a daemon thread."""
    import uvicorn

    app = create_app(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1, access_log=False
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="mock-judge")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("mock judge server did not start within 10 s")
        time.sleep(0.01)
    try:
        yield RunningMockJudge(base_url=f"http://{host}:{port}/v1", app=app)
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
