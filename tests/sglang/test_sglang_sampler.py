"""SGLangSampler against the fake server: generation, in-flight updates, resumes, routing, failures.

Expected values come from the toy backend's closed form (conftest.py).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sglang_toy import MOE_LAYERS, NUM_HIDDEN_LAYERS, TOPK, make_server, toy_generate, toy_routing

from labrl.errors import SamplerError
from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig
from labrl.harness.types import GenerateRequest, Sampler, SamplingParams

pytestmark = pytest.mark.timeout(60)


def make_sampler(urls, tmp_path: Path, written: list | None = None, **overrides) -> SGLangSampler:
    cfg = SGLangSamplerConfig(
        urls=tuple(urls),
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        moe_layers=MOE_LAYERS,
        topk=TOPK,
        export_dir=str(tmp_path / "exports"),
        retry_backoff_s=0.0,
        **overrides,
    )

    def writer(weights, path):
        path.mkdir(parents=True)
        (path / "marker").write_text("x")
        if written is not None:
            written.append((path.name, sorted(weights)))

    return SGLangSampler(cfg, weight_writer=writer)


def req(rid: str, prompt=(1, 2, 3), n: int = 5, routed: bool = True) -> GenerateRequest:
    return GenerateRequest(
        rid=rid,
        input_ids=tuple(prompt),
        sampling=SamplingParams(max_new_tokens=n),
        return_routed_experts=routed,
    )


PAD = np.broadcast_to(np.arange(TOPK, dtype=np.int32), (1, len(MOE_LAYERS), TOPK))


def expected_rows(tokens_fed_with_version: list[tuple[int, int]]) -> np.ndarray:
    """Routing rows from (token, version it was fed under) per token."""
    rows = np.concatenate([toy_routing([t], v) for t, v in tokens_fed_with_version], axis=0)
    return rows


async def test_generate_matches_closed_form(served, tmp_path):
    url = served(make_server())
    async with make_sampler([url], tmp_path) as sampler:
        assert isinstance(sampler, Sampler)
        (res,) = await sampler.generate([req("g/0")])
    toks, lps = toy_generate([1, 2, 3], 5, 0)
    assert res.output_ids == toks
    assert res.logprobs_T == pytest.approx(lps)
    assert res.versions_T == [0] * 5
    assert res.finish_reason == "length"
    full = toy_routing([1, 2, 3, *toks], 0)  # (8, L, K)
    want = np.concatenate([full[:-1], PAD], axis=0)  # last row padded with experts 0..K-1
    assert res.routed_experts_T_L_K.shape == (8, len(MOE_LAYERS), TOPK)
    assert np.array_equal(res.routed_experts_T_L_K, want)


async def test_stop_token_and_asgi_transport(tmp_path):
    server = make_server()
    transport = httpx.ASGITransport(app=server.app)
    cfg = SGLangSamplerConfig(
        urls=("http://fake",), num_hidden_layers=3, moe_layers=MOE_LAYERS, topk=TOPK, export_dir=str(tmp_path)
    )
    toks, _ = toy_generate([1, 2, 3], 5, 0)
    stop = toks[2]
    async with SGLangSampler(cfg, weight_writer=lambda w, p: None, transport=transport) as sampler:
        r = GenerateRequest(
            rid="s", input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=5, stop_token_ids=(stop,))
        )
        (res,) = await sampler.generate([r])
    assert res.output_ids == toks[: toks.index(stop) + 1]
    assert res.finish_reason == "stop"
    assert res.routed_experts_T_L_K is None


async def _generate_with_update_midway(sampler, server, n=30, min_tokens=4):
    task = asyncio.create_task(sampler.generate([req("u/0", n=n)]))
    while True:  # wait until a few tokens exist, then update in flight
        running = server.running
        if running and len(running[0].out) >= min_tokens:
            break
        await asyncio.sleep(0.005)
    await sampler.update_weights({"w": torch.ones(2)}, 1)
    (res,) = await task
    return res


def _check_switch(res, n):
    k = res.versions_T.count(0)
    assert 0 < k < n and res.versions_T == [0] * k + [1] * (n - k)
    first, lp0 = toy_generate([1, 2, 3], k, 0)
    rest, lp1 = toy_generate([1, 2, 3, *first], n - k, 1)
    assert res.output_ids == first + rest
    assert res.logprobs_T == pytest.approx(lp0 + lp1)
    return k, first, rest


async def test_inflight_update_retract_0523_tags_tokens_by_span(served, tmp_path):
    server = make_server(tick_delay_s=0.01)
    url = served(server)
    written = []
    async with make_sampler([url], tmp_path, written) as sampler:
        res = await _generate_with_update_midway(sampler, server)
        assert sampler.version == 1
    _k, first, rest = _check_switch(res, 30)
    assert server.log == ["pause:retract", "update_disk:1", "continue"]
    assert written == [("v000001", ["w"])]
    assert server.backend.updates[0][0] == 1
    assert res.info["resumes"] == 0 and res.info["exact_versions"]
    # routing rows: the retracted request was prefilled again after the update (SGLang frees its KV
    # cache), so every row of the prefix is re-routed under version 1, like the rows fed in after it
    prompt = [1, 2, 3]
    rows = expected_rows([(t, 1) for t in prompt + first + rest[:-1]])
    assert np.array_equal(res.routed_experts_T_L_K, np.concatenate([rows, PAD]))
    # (the old rows differ: a client that kept them would replay a routing the final KV never used)
    stale = expected_rows([(t, 0) for t in prompt + first[:-1]])
    assert not np.array_equal(res.routed_experts_T_L_K[: len(stale)], stale)


async def test_abort_mode_0515_resumes_from_prefix(served, tmp_path):
    server = make_server(version="0.5.15", tick_delay_s=0.01)
    url = served(server)
    async with make_sampler([url], tmp_path, pause_mode="abort") as sampler:
        assert not sampler.servers[0].has_weight_update_session
        res = await _generate_with_update_midway(sampler, server)
    _k, first, rest = _check_switch(res, 30)
    assert res.info["resumes"] == 1 and res.info["exact_versions"]
    assert server.log == ["pause:abort", "update_disk:1", "continue"]
    # the resumed run prefilled prompt + first under version 1: the client keeps that run's rows for the
    # whole sequence (the routing its KV cache was built with), not the first run's prefix rows
    prompt = [1, 2, 3]
    rows = expected_rows([(t, 1) for t in prompt + first + rest[:-1]])
    assert np.array_equal(res.routed_experts_T_L_K, np.concatenate([rows, PAD]))


async def test_retract_on_0515_marks_versions_inexact(served, tmp_path):
    server = make_server(version="0.5.15", tick_delay_s=0.01)
    url = served(server)
    async with make_sampler([url], tmp_path) as sampler:
        res = await _generate_with_update_midway(sampler, server)
        assert sampler.stats["inexact_versions"] == 1
    # no spans: every token carries the older version (staleness over-, never under-estimated)
    assert res.versions_T == [0] * 30 and not res.info["exact_versions"]


async def test_routed_experts_without_server_flag_is_a_clear_error(served, tmp_path):
    url = served(make_server(enable_return_routed_experts=False))
    async with make_sampler([url], tmp_path) as sampler:
        msg = f"{url}: routed experts requested but the server runs without --enable-return-routed-experts"
        with pytest.raises(SamplerError, match=re.escape(msg)):
            await sampler.generate([req("r/0")])
        (res,) = await sampler.generate([req("r/1", routed=False)])
        assert len(res.output_ids) == 5


async def test_fake_server_rejects_what_sglang_rejects(served):
    server = make_server(tick_delay_s=0.02)
    url = served(server)
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 400
        assert r.json() == {
            "error": {"message": "SamplingParams.__init__() got an unexpected keyword argument 'max_tokens'"}
        }
        r = await c.post(
            "/generate",
            json={"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3},
        )
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "routed_experts_start_len=3 must be in [0, prompt_tokens=2]"
        busy = asyncio.create_task(
            c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 20}})
        )
        while not server.running:
            await asyncio.sleep(0.005)
        r = await c.post("/flush_cache")
        assert r.status_code == 400 and r.text.startswith("Cache not flushed.")
        assert (await c.post("/pause_generation", json={"mode": "in_place"})).json()["success"]
        r = await c.post("/update_weights_from_disk", json={"model_path": "/x", "flush_cache": True})
        assert r.json()["success"] is False and "pass flush_cache=false" in r.json()["message"]
        r = await c.post(
            "/update_weights_from_disk",
            json={"model_path": "/x", "flush_cache": False, "weight_version": "3"},
        )
        assert r.json()["success"] is True
        r = await c.post("/update_weights_from_distributed", json={"names": []})
        assert r.json() == {
            "success": False,
            "message": "update_weights_from_distributed requires begin_weight_update first",
        }
        await c.post("/continue_generation")
        done = (await busy).json()
        assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
        spans = done["meta_info"]["weight_versions"]
        assert spans[0]["version"] == "0" and spans[-1] == {
            "version": "3",
            "start": spans[-1]["start"],
            "end": 20,
        }
        assert (await c.post("/flush_cache")).status_code == 200


async def test_0515_has_no_weight_update_session(served):
    url = served(make_server(version="0.5.15"))
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        assert (await c.post("/begin_weight_update", json={})).status_code == 404
        assert (await c.get("/server_info")).json()["version"] == "0.5.15"
        # 0.5.15 has no routed_experts_start_len field: ignored like any unknown top-level field
        r = await c.post(
            "/generate",
            json={
                "input_ids": [1, 2],
                "routed_experts_start_len": 9,
                "sampling_params": {"max_new_tokens": 1},
            },
        )
        assert r.status_code == 200


async def test_least_loaded_spreads_and_dead_server_is_retried_elsewhere(served, tmp_path):
    servers = [make_server(tick_delay_s=0.005), make_server(tick_delay_s=0.005)]
    urls = [served(s) for s in servers]
    async with make_sampler(urls, tmp_path) as sampler:
        results = await sampler.generate([req(f"t{i}/0", n=6) for i in range(4)])
        used = [r.info["servers"][0] for r in results]
        assert sorted(used) == sorted(urls * 2)
        served.threads[0].stop()  # server 0 dies
        results = await sampler.generate([req(f"d{i}/0", n=6) for i in range(4)])
        assert not sampler.servers[0].alive and sampler.servers[1].alive
        toks, _ = toy_generate([1, 2, 3], 6, 0)
        assert all(r.output_ids == toks and r.info["servers"] == [urls[1]] for r in results)
        assert sampler.stats["retried"] >= 1
        served.threads[1].stop()
        with pytest.raises(SamplerError, match=re.escape("no live SGLang server left")):
            await sampler.generate([req("z/0")])


async def test_consistent_routing_keeps_a_group_on_one_server(served, tmp_path):
    urls = [served(make_server()), served(make_server())]
    async with make_sampler(urls, tmp_path, routing="consistent") as sampler:
        results = await sampler.generate(
            # 32 groups: all hashing onto one of the 2 servers has probability 2**-31 (6 gave ~3 %)
            [req(f"task{g}/{i}", n=2, routed=False) for g in range(32) for i in range(3)]
        )
    by_group: dict[str, set[str]] = {}
    for r in results:
        by_group.setdefault(r.rid.split("/")[0], set()).update(r.info["servers"])
    assert all(len(s) == 1 for s in by_group.values())
    assert len(set().union(*by_group.values())) == 2


async def test_bad_request_is_not_retried(served, tmp_path):
    url = served(make_server())
    async with make_sampler([url], tmp_path) as sampler:
        with pytest.raises(SamplerError, match=re.escape("rejected the request: HTTP 400")):
            await sampler._control(sampler.servers[0], "/pause_generation", {"mode": "sideways"})
        with pytest.raises(SamplerError, match=re.escape("weight version must increase: have 0, got 0")):
            await sampler.update_weights({}, 0)


async def test_in_place_update_tags_tokens_from_the_first_one_after_the_update(served, tmp_path):
    """in_place: KV kept, no flush; tokens generated before the pause carry 0, every later one 1."""
    server = make_server(tick_delay_s=0.01)
    at_update: list[int] = []
    apply = server.backend.update_weights

    async def recording(weights, version, *, force=False):
        at_update.append(len(server.running[0].out))  # tokens that exist when the weights change
        await apply(weights, version, force=force)

    server.backend.update_weights = recording
    url = served(server)
    async with make_sampler([url], tmp_path, pause_mode="in_place") as sampler:
        res = await _generate_with_update_midway(sampler, server)
        assert sampler.version == 1
    k, _first, _rest = _check_switch(res, 30)
    assert at_update == [k]
    assert server.log == ["pause:in_place", "update_disk:1", "continue"]
    assert res.info["resumes"] == 0 and res.info["exact_versions"]
