"""A deterministic in-process backend and fake-server factory for the SGLang tests.

``ToyBackend`` is a ``Sampler`` whose next token and log-prob are functions
of the context and its weight version, so expected outputs are computed by
hand in the tests (no randomness, no model):

    next token      = (sum(context) + version) % VOCAB
    logprob         = -(next token % 7) / 10 - version
    routed experts  = position t, MoE layer l: [(tok_t + l + version) % E, (tok_t + l + version + 1) % E]
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from labrl.harness.types import GenerateRequest, GenerateResult
from labrl.testing.fake_sglang_server import FakeServerConfig, FakeSGLangServer

VOCAB = 50
NUM_EXPERTS = 4
NUM_HIDDEN_LAYERS = 3
MOE_LAYERS = (1, 2)  # layer 0 is dense
TOPK = 2


def toy_next(context: Sequence[int], version: int) -> tuple[int, float]:
    tok = (sum(context) + version) % VOCAB
    return tok, -(tok % 7) / 10 - version


def toy_routing(tokens: Sequence[int], version: int) -> np.ndarray:
    out = np.zeros((len(tokens), len(MOE_LAYERS), TOPK), np.int32)  # (T, L, K)
    for t, tok in enumerate(tokens):
        for li in range(len(MOE_LAYERS)):
            out[t, li] = [(tok + li + version) % NUM_EXPERTS, (tok + li + version + 1) % NUM_EXPERTS]
    return out


def toy_generate(prompt: Sequence[int], n: int, version: int) -> tuple[list[int], list[float]]:
    ctx, toks, lps = list(prompt), [], []
    for _ in range(n):
        tok, lp = toy_next(ctx, version)
        toks.append(tok)
        lps.append(lp)
        ctx.append(tok)
    return toks, lps


class ToyBackend:
    """Deterministic ``Sampler`` (see module docstring)."""

    def __init__(self) -> None:
        self._version = 0
        self.updates: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.calls = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        self.calls += 1
        await asyncio.sleep(0)
        results = []
        for req in requests:
            toks, lps = toy_generate(req.input_ids, req.sampling.max_new_tokens, self._version)
            routed = (
                toy_routing(list(req.input_ids) + toks, self._version) if req.return_routed_experts else None
            )
            results.append(
                GenerateResult(
                    req.rid, toks, lps, [self._version] * len(toks), "length", routed_experts_T_L_K=routed
                )
            )
        return results

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *, force: bool = False
    ) -> None:
        self.updates.append((version, dict(weights)))
        self._version = version

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None


def make_server(version: str = "0.5.23", **overrides) -> FakeSGLangServer:
    cfg = FakeServerConfig(
        sglang_version=version,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        moe_layers=MOE_LAYERS,
        topk=TOPK,
        **overrides,
    )
    return FakeSGLangServer(
        ToyBackend(), cfg, load_weights=lambda path: {"w": torch.tensor([float(len(path))])}
    )
