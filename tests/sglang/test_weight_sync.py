"""Distributed weight updates through the fake SGLang server (gloo, CPU), end to end.

The fake loads updates by HF name the way SGLang's ``load_weights`` does and
skips unknown names silently like it (``server.weights.skipped`` counts them):
``assert_all_loaded`` is the check every test makes after an update.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest
import torch
from weight_sync_support import MODELS, learner_logprobs, megatron_state, transformers_checkpoint_layout

from labrl.errors import SamplerError
from labrl.harness.models.hf_export import export_hf_checkpoint, hf_weights
from labrl.harness.samplers.sglang.dist import WeightBroadcaster
from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig, make_sglang_sampler
from labrl.harness.types import GenerateRequest, SamplingParams
from labrl.ports import free_port
from labrl.testing.fake_sglang_server import ServerThread, local_fake_server

pytestmark = [pytest.mark.timeout(240)]

CFG = MODELS["qwen3_moe"]
PROMPT = (1, 2, 3, 4, 5)


def assert_all_loaded(server) -> None:
    assert server.weights.skipped == [], f"the server skipped {len(server.weights.skipped)} names"


def _config(url: str, **overrides) -> SGLangSamplerConfig:
    base = {
        "urls": (url,),
        "weight_transport": "distributed",
        "group_backend": "gloo",
        "master_port": free_port(),
        "group_timeout_s": 60.0,
    }
    return SGLangSamplerConfig(**(base | overrides))


def _request(rid: str, n: int = 6) -> GenerateRequest:
    return GenerateRequest(
        rid=rid,
        input_ids=PROMPT,
        sampling=SamplingParams(max_new_tokens=n, temperature=0.0),
        return_routed_experts=True,
    )


@pytest.fixture
def served_model(tmp_path):
    """A fake server holding a checkpoint of another init (seed 123) than the learner's (seed 0)."""
    ckpt = export_hf_checkpoint(megatron_state(CFG, seed=123), CFG, tmp_path / "served", tokenizer=False)
    return str(ckpt)


async def test_distributed_update_serves_the_learner_weights(served_model):
    torch.set_num_threads(1)
    learner = megatron_state(CFG, seed=0)
    server = local_fake_server(served_model, group_timeout_s=60)
    with ServerThread(server.app) as url:
        # buckets of 64 KiB: the ~0.5 MB model goes in several update calls
        async with make_sglang_sampler(_config(url, bucket_mb=1 / 16), CFG) as sampler:
            (before,) = await sampler.generate([_request("w/0")])
            await sampler.update_weights(learner, 1)
            (after,) = await sampler.generate([_request("w/1")])
            assert sampler.stats["buckets_sent"] > 1 and sampler.stats["groups_built"] == 1
    assert_all_loaded(server)
    expected = hf_weights(learner, CFG)
    held = server.weights.hf_state()
    # the fake's tensors are the learner's exported HF tensors: names, shapes, values
    assert set(held) == set(expected)
    assert all(torch.equal(held[k], v) for k, v in expected.items())
    # what travelled: exactly the transformers checkpoint's names, shapes and dtypes, each once
    sent = {name: (shape, getattr(torch, dtype)) for name, dtype, shape in server.received}
    assert len(server.received) == len(sent) == len(expected)
    assert sent == transformers_checkpoint_layout(CFG, torch.float32)
    updates = [e for e in server.log if e.startswith("update_distributed")]
    assert len(updates) == sampler.stats["buckets_sent"] and updates[-1] == "update_distributed:1"
    # generation follows the weights it holds: the learner's log-probs for the same tokens
    assert after.versions_T == [1] * 6 and before.versions_T == [0] * 6
    ids = list(PROMPT) + after.output_ids
    assert after.logprobs_T == pytest.approx(learner_logprobs(CFG, learner, ids, 6), abs=1e-4)
    assert before.logprobs_T != pytest.approx(after.logprobs_T, abs=1e-3)


async def test_megatron_names_load_nothing_and_fail_the_check(served_model):
    """The old bug: megatron names go through, SGLang-style loading skips them all, nothing changes."""
    server = local_fake_server(served_model, group_timeout_s=60)
    old = server.weights.hf_state()
    learner = megatron_state(CFG, seed=0)
    with ServerThread(server.app) as url:
        sampler = SGLangSampler(
            _config(url).with_model(CFG), broadcaster=WeightBroadcaster(), to_hf=lambda state: state
        )
        async with sampler:
            await sampler.update_weights(learner, 1)  # answered "success", as SGLang does
    assert server.weight_version == "1"
    assert sorted(server.weights.skipped) == sorted(learner)
    assert all(torch.equal(server.weights.hf_state()[k], v) for k, v in old.items())
    with pytest.raises(AssertionError, match=f"the server skipped {len(learner)} names"):
        assert_all_loaded(server)


async def test_wrong_group_name_fails_within_the_timeout(served_model):
    """SGLang's PrefixStore rendezvous: ends that disagree on the group name never meet."""

    class OtherName(WeightBroadcaster):
        def init_group(self, **kw):
            super().init_group(**(kw | {"group_name": "not_the_servers"}))

    # long enough for the receiver process to start and meet the trainer at the TCP store even on a
    # loaded machine: the failure is then the prefixed keys, never found (the test's timeout bounds it)
    server = local_fake_server(served_model, group_timeout_s=20)
    with ServerThread(server.app) as url:
        cfg = _config(url, group_timeout_s=20).with_model(CFG)
        sampler = SGLangSampler(cfg, broadcaster=OtherName(), to_hf=lambda s: hf_weights(s, CFG))
        async with sampler:
            with pytest.raises(SamplerError, match="init_weights_update_group failed") as err:
                await sampler.update_weights(megatron_state(CFG, seed=0), 1)
    # the trainer waited for keys under its own prefix, which the server never wrote
    assert "wait timeout" in str(err.value) and "/not_the_servers/" in str(err.value)
    assert "init_group" not in server.log


async def test_server_restart_rebuilds_the_group(served_model):
    learner = megatron_state(CFG, seed=0)
    port = free_port()
    first = local_fake_server(served_model, group_timeout_s=60)
    thread = ServerThread(first.app, port=port)
    url = thread.start()
    try:
        async with make_sglang_sampler(_config(url), CFG) as sampler:
            await sampler.update_weights(learner, 1)
            # the server process dies (its group end with it) and a new one starts on the same port,
            # holding the launch checkpoint under the launch version
            thread.stop()
            first._receiver.destroy()
            second = local_fake_server(served_model, group_timeout_s=60)
            thread = ServerThread(second.app, port=port)
            thread.start()
            newer = {k: v * 1.01 for k, v in learner.items()}
            await sampler.update_weights(newer, 2)
            assert sampler.stats["groups_built"] == 2
            (res,) = await sampler.generate([_request("r/0")])
    finally:
        thread.stop()
    # the new process joined a new group before its first update
    assert second.log[:5] == ["pause:retract", "init_group", "begin", "update_distributed:2", "end"]
    assert second.weight_version == "2"
    assert_all_loaded(second)
    expected = hf_weights(newer, CFG)
    assert all(torch.equal(second.weights.hf_state()[k], v) for k, v in expected.items())
    assert res.versions_T == [2] * 6


async def test_deterministic_inference_needs_the_server_flag(served_model):
    server = local_fake_server(served_model)
    with ServerThread(server.app) as url:
        cfg = SGLangSamplerConfig(urls=(url,), export_dir="/unused", deterministic_inference=True)
        sampler = make_sglang_sampler(cfg, CFG)
        with pytest.raises(SamplerError, match="without --enable-deterministic-inference"):
            await sampler.start()
        await sampler.close()
    seeded = local_fake_server(served_model, enable_deterministic_inference=True)
    with ServerThread(seeded.app) as url:
        cfg = SGLangSamplerConfig(urls=(url,), export_dir="/unused", deterministic_inference=True)
        async with make_sglang_sampler(cfg, CFG) as sampler:
            req = GenerateRequest(
                rid="d/0",
                input_ids=PROMPT,
                sampling=SamplingParams(max_new_tokens=8, temperature=1.0, seed=7),
            )
            a, b = await sampler.generate([req, req.model_copy(update={"rid": "d/1"})])
    assert a.output_ids == b.output_ids


_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig
    from labrl.harness.types import GenerateRequest, SamplingParams

    async def main():
        cfg = SGLangSamplerConfig(urls=(sys.argv[1],), num_hidden_layers=2, moe_layers=(0, 1), topk=2,
                                  export_dir="/unused")
        async with SGLangSampler(cfg, weight_writer=lambda w, p: None) as s:
            req = GenerateRequest(rid="task/0", input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=2))
            await s.generate([req, req])

    asyncio.run(main())
    """
)


async def test_request_ids_unique_across_processes(served_model):
    """Two client processes send the same task rid to one server: SGLang's rids never collide."""
    server = local_fake_server(served_model)
    with ServerThread(server.app) as url:
        procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, url]) for _ in range(2)]
        codes = await asyncio.gather(*(asyncio.to_thread(p.wait, 120) for p in procs))
    assert codes == [0, 0]
    assert len(server.rids) == 4 and len(set(server.rids)) == 4
    assert all(r.startswith("task/0#") for r in server.rids)
