"""An LLM judge over any OpenAI-compatible chat endpoint (SGLang, vLLM, a hosted API).

``JudgeClient.judge(items, response, question)`` returns, for each ``llm``
item, ``samples`` scores in [0, 1]. It POSTs ``{base_url}/chat/completions``
(``base_url`` as for the OpenAI client, e.g. ``http://127.0.0.1:30000/v1``)
with the isolated prompt of ``labrl.verifiers.rubric.prompt`` and a
``response_format`` JSON schema, and parses the answer strictly.

- ``batch="response"``: one call per (response, sample) scoring every item
  not already cached; ``batch="item"``: one call per (item, sample).
- Concurrency: at most ``max_concurrency`` requests in flight per client.
- Retries: transport errors (connect, read, timeouts), HTTP 5xx and 429 are
  retried ``max_retries`` times with backoff ``min(backoff_s * 2**attempt,
  backoff_max_s)`` (``labrl.resilience.Backoff``, no jitter; a 429's
  ``Retry-After`` wins when larger, up to the cap).
  Other 4xx are not retried. A malformed answer is not retried either: it is
  a ``VerifierError`` at once.
- Every request is bounded by ``timeout_s`` (httpx's timeout and an
  ``asyncio.timeout`` around the whole request, so in-process ASGI
  transports are bounded too).
- Cache: parsed scores keyed by (model, base_url, prompt version, item text,
  question hash, response hash, temperature, sample index); only valid
  answers are cached.
- The API key is read from the environment variable named ``api_key_env`` at
  request time; it never appears in configs, errors or logs.

Errors, translated in one place (``_post``)::

    httpx.TransportError / timeout, 5xx, 429 (after retries) -> JudgeError
    401, 403                                                -> JudgeAuthError (no retry; stops the run,
                                                               as a lab refusing our key does)
    other 4xx                                               -> JudgeError (no retry)
    answer that does not parse / score out of range          -> VerifierError

``base_url="mock://"`` runs the CI mock judge in-process (``mock_judge``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from labrl.errors import ConfigError, JudgeAuthError, JudgeError, VerifierError
from labrl.redact import redact
from labrl.resilience import Backoff, retry_after_s
from labrl.verifiers.rubric.items import LLMItem
from labrl.verifiers.rubric.prompt import PROMPT_VERSION, build_messages, parse_scores, response_format

log = logging.getLogger(__name__)

MOCK_SCHEME = "mock://"
AUTH_STATUSES = frozenset({401, 403})  # the judge refused our credentials: JudgeAuthError


class JudgeConfig(BaseModel):
    """One judge endpoint and how to call it. Plain values only (it serialises)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(default=MOCK_SCHEME, description="OpenAI-style base URL ending in /v1, or mock://")
    model: str = Field(default="mock-keyword-judge", min_length=1)
    api_key_env: str | None = Field(default=None, description="name of the env var holding the API key")
    batch: Literal["response", "item"] = "response"
    samples: int = Field(default=1, ge=1, le=64)
    temperature: float = Field(default=0.0, ge=0, le=2)
    max_tokens: int = Field(default=1024, ge=16)
    structured_output: Literal["json_schema", "json_object", "none"] = "json_schema"
    timeout_s: float = Field(default=60.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    backoff_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    max_concurrency: int = Field(default=8, ge=1)
    cache: bool = True
    extra_body: dict[str, Any] = Field(default_factory=dict, description="merged into each request body")

    @field_validator("base_url")
    @classmethod
    def _url(cls, url: str) -> str:
        if url == MOCK_SCHEME:
            return url
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {url!r} must start with http:// or https:// (or be {MOCK_SCHEME!r})")
        return url.rstrip("/")

    @field_validator("extra_body")
    @classmethod
    def _no_overrides(cls, body: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(body) & {"model", "messages", "response_format", "n"})
        if reserved:
            raise ValueError(f"extra_body must not set {reserved}: they are set by the judge client")
        return body

    @property
    def url(self) -> str:
        base = "http://mock-judge/v1" if self.base_url == MOCK_SCHEME else self.base_url
        return f"{base}/chat/completions"


class JudgeCache:
    """A bounded in-memory LRU of parsed item scores, shared by every client that is handed it."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> tuple[float, str] | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value: tuple[float, str]) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


_DEFAULT_CACHE = JudgeCache()


def default_cache() -> JudgeCache:
    """The process-wide cache used when a client is given none."""
    return _DEFAULT_CACHE


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class JudgeStats(BaseModel):
    requests: int = 0
    retries: int = 0
    cache_hits: int = 0


class JudgeClient:
    """Scores rubric items with one judge endpoint; see the module docstring."""

    def __init__(
        self,
        config: JudgeConfig,
        *,
        cache: JudgeCache | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.cache = cache if cache is not None else default_cache()
        self.stats = JudgeStats()
        self._sleep = sleep
        self._backoff = Backoff(
            config.backoff_s, config.backoff_max_s, retry_after_cap_s=config.backoff_max_s
        )
        if transport is None and config.base_url == MOCK_SCHEME:
            from labrl.verifiers.rubric.mock_judge import MockJudgeConfig, create_app

            transport = httpx.ASGITransport(app=create_app(MockJudgeConfig()))
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"JudgeClient(model={self.config.model!r}, base_url={self.config.base_url!r})"

    @property
    def name(self) -> str:
        return self.config.model

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> JudgeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- public -----------------------------------------------------------------

    async def judge(
        self, items: Sequence[LLMItem], response: str, question: str | None = None
    ) -> dict[str, list[tuple[float, str]]]:
        """``{item id: [(score, rationale) per sample]}`` for every item in ``items``."""
        results: dict[str, list[tuple[float, str] | None]] = {
            item.id: [None] * self.config.samples for item in items
        }  # type: ignore[misc]
        todo: list[tuple[int, list[LLMItem]]] = []  # (sample, items still to ask for)
        for sample in range(self.config.samples):
            missing = []
            for item in items:
                cached = (
                    self.cache.get(self._key(item, response, question, sample)) if self.config.cache else None
                )
                if cached is None:
                    missing.append(item)
                else:
                    results[item.id][sample] = cached  # type: ignore[index]
                    self.stats.cache_hits += 1
            if missing:
                if self.config.batch == "response":
                    todo.append((sample, missing))
                else:
                    todo.extend((sample, [item]) for item in missing)
        answers = await _gather([self._ask(batch, response, question) for _, batch in todo])
        for (sample, batch), answer in zip(todo, answers, strict=True):
            for item in batch:
                value = answer[item.id]  # type: ignore[index]
                results[item.id][sample] = value  # type: ignore[index]
                if self.config.cache:
                    self.cache.put(self._key(item, response, question, sample), value)
        return {item_id: [v for v in values if v is not None] for item_id, values in results.items()}

    # -- internals --------------------------------------------------------------

    def _key(self, item: LLMItem, response: str, question: str | None, sample: int) -> str:
        c = self.config
        parts = [c.model, c.base_url, PROMPT_VERSION, item.text, _sha(question or ""), _sha(response)]
        parts += [f"{c.temperature:g}", str(sample)]
        return _sha("\x1f".join(parts))

    def _headers(self) -> dict[str, str]:
        if self.config.api_key_env is None:
            return {}
        key = os.environ.get(self.config.api_key_env)
        if not key:
            raise ConfigError(
                f"judge {self.config.model!r} reads its API key from ${self.config.api_key_env}, which is not set: "
                "export it or set api_key_env=None"
            )
        return {"Authorization": f"Bearer {key}"}

    def _refused_credentials(self) -> str:
        """What a 401/403 says about our key: where it comes from (never the key itself)."""
        if self.config.api_key_env is None:
            return "refused a request without credentials (set api_key_env to the variable holding the key)"
        return f"refused the credentials in ${self.config.api_key_env}"

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                transport=self._transport, timeout=httpx.Timeout(self.config.timeout_s)
            )
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        return self._http

    async def _ask(
        self, items: Sequence[LLMItem], response: str, question: str | None
    ) -> dict[str, tuple[float, str]]:
        ids = [item.id for item in items]
        body: dict[str, Any] = {
            **self.config.extra_body,
            "model": self.config.model,
            "messages": build_messages(items, response, question),
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        fmt = response_format(ids, self.config.structured_output)  # type: ignore[arg-type]
        if fmt is not None:
            body["response_format"] = fmt
        payload = await self._post(body)
        try:
            content = payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise VerifierError(
                f"judge {self.config.model!r} answered without choices[0].message.content: {str(payload)[:200]!r}"
            ) from None
        return parse_scores(content, ids)  # type: ignore[arg-type]

    async def _post(self, body: dict[str, Any]) -> Any:
        client = self._client()
        assert self._semaphore is not None
        headers = self._headers()
        name = self.config.model
        attempt = 0
        while True:
            retry_after = None
            try:
                async with self._semaphore:
                    self.stats.requests += 1
                    async with asyncio.timeout(self.config.timeout_s):
                        reply = await client.post(self.config.url, json=body, headers=headers)
                if reply.status_code == 200:
                    try:
                        return reply.json()
                    except json.JSONDecodeError:
                        raise VerifierError(
                            f"judge {name!r} answered HTTP 200 with a body that is not JSON"
                        ) from None
                retryable = reply.status_code == 429 or reply.status_code >= 500
                retry_after = reply.headers.get("retry-after")
                sent = headers.get("Authorization", "").removeprefix("Bearer ")
                failure = f"HTTP {reply.status_code}: {redact(reply.text, [sent])[:200]!r}"
                if reply.status_code in AUTH_STATUSES:
                    raise JudgeAuthError(
                        f"judge {name!r} at {self.config.url} {self._refused_credentials()}: {failure}"
                    )
                if not retryable:
                    raise JudgeError(f"judge {name!r} at {self.config.url} refused the request: {failure}")
            except (httpx.TransportError, TimeoutError) as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if attempt >= self.config.max_retries:
                raise JudgeError(
                    f"judge {name!r} at {self.config.url} failed after {attempt + 1} attempt(s): {failure}"
                )
            delay = self._backoff.delay(attempt, retry_after=retry_after_s(retry_after))
            log.warning("judge %s: %s; retry %d in %.2f s", name, failure, attempt + 1, delay)
            self.stats.retries += 1
            attempt += 1
            await self._sleep(delay)


async def _gather(coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` concurrently; the first failure cancels the rest and is raised as itself."""
    if not coros:
        return []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as group_error:
        first = group_error.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]
