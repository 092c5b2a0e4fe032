"""Issue 17 on CUDA: the bf16 bucketed export from a CUDA learner, and the NCCL update group.

- bucketed export: ``hf_weights`` of a bf16 megatron state on CUDA, cut by ``plan_buckets``
  as ``SGLangSampler`` does, equals the CPU export bit for bit, bucket by bucket;
- the update group: ``WeightBroadcaster`` (this process) and the fake server's
  ``WeightReceiver`` (a spawned process) rendezvous through SGLang's prefix store and move
  a full bf16 update. Over NCCL the two ranks need two GPUs: NCCL refuses two ranks of one
  group on one device ("Duplicate GPU detected"), so a one-GPU node runs the same path with
  gloo carrying the CUDA tensors instead.
"""

from __future__ import annotations

import threading

import pytest
import torch
from weight_sync_support import MODELS, megatron_state

from labrl.harness.models.hf_export import hf_weights
from labrl.harness.samplers.sglang.dist import WeightBroadcaster, WeightReceiver, plan_buckets, receive_device
from labrl.ports import free_port

CFG = MODELS["qwen3_moe"]


def _bf16_state(device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device=device, dtype=torch.bfloat16) for k, v in megatron_state(CFG, seed=4).items()}


def test_bucketed_bf16_export_on_cuda_equals_the_cpu_export():
    on_gpu, on_cpu = hf_weights(_bf16_state("cuda"), CFG), hf_weights(_bf16_state("cpu"), CFG)
    assert list(on_gpu) == list(on_cpu)
    assert {v.device.type for v in on_gpu.values()} == {"cuda"}
    assert {v.dtype for v in on_gpu.values()} == {torch.bfloat16}
    sizes = [v.numel() * v.element_size() for v in on_gpu.values()]
    bucket_bytes = 64 << 10
    buckets = plan_buckets(sizes, bucket_bytes)
    assert len(buckets) > 1 and [i for b in buckets for i in b] == list(range(len(sizes)))
    names = list(on_gpu)
    for b in buckets:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= bucket_bytes
        for i in b:
            assert torch.equal(on_gpu[names[i]].cpu(), on_cpu[names[i]]), names[i]


def _receive(receiver: WeightReceiver, part: list[str], tensors: dict, into: list) -> None:
    shapes = [list(tensors[n].shape) for n in part]
    into.extend(receiver.receive(part, ["bfloat16"] * len(part), shapes, lambda pairs: pairs))


def _round_trip(backend: str, receiver_device: str, sender_device: str = "cuda:0") -> None:
    """A bf16 update from ``sender_device`` through SGLang's rendezvous, in 64 KiB buckets."""
    tensors = hf_weights(_bf16_state(sender_device), CFG)
    names = list(tensors)
    port = free_port()
    broadcaster, receiver = (
        WeightBroadcaster(sender_device),
        WeightReceiver(timeout_s=120, device=receiver_device),
    )
    # both ends block in the rendezvous until the other arrives: the receiver starts in a thread
    joined: list[BaseException | None] = []

    def join() -> None:
        try:
            receiver.init_group(
                master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                group_name="labrl_weights", backend=backend,
            )  # fmt: skip
            joined.append(None)
        except BaseException as exc:  # reported below, in the test's thread
            joined.append(exc)

    t = threading.Thread(target=join)
    t.start()
    broadcaster.init_group(
        master_address="127.0.0.1", master_port=port, world_size=2, group_name="labrl_weights",
        backend=backend, timeout_s=120,
    )  # fmt: skip
    t.join(timeout=180)
    assert joined == [None], joined
    try:
        for bucket in plan_buckets([v.numel() * v.element_size() for v in tensors.values()], 64 << 10):
            part = [names[i] for i in bucket]
            got: list = []
            recv = threading.Thread(target=_receive, args=(receiver, part, tensors, got))
            recv.start()
            broadcaster.broadcast([tensors[n] for n in part])
            recv.join(timeout=120)
            assert [n for n, _ in got] == part
            for n, v in got:
                assert v.dtype == torch.bfloat16 and torch.equal(v, tensors[n].cpu()), n
    finally:
        broadcaster.destroy()
        receiver.destroy()


def test_update_group_on_one_gpu_moves_cuda_tensors_over_gloo():
    assert receive_device("nccl") == torch.device("cuda", 0)
    _round_trip("gloo", "cpu")


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs the two ranks on two GPUs (Duplicate GPU detected)"
)
def test_nccl_update_group_between_two_processes_on_two_gpus():
    _round_trip("nccl", "cuda:1")


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs the two ranks on two GPUs (Duplicate GPU detected)"
)
async def test_sampler_distributed_update_over_nccl_to_the_fake_server(tmp_path):
    """``SGLangSampler`` (transport distributed, backend nccl, bf16) -> the fake server receiving on cuda:1."""
    from labrl.harness.models.hf_export import export_hf_checkpoint
    from labrl.harness.samplers.sglang.sampler import SGLangSamplerConfig, make_sglang_sampler
    from labrl.testing.fake_sglang_server import ServerThread, local_fake_server

    served = export_hf_checkpoint(megatron_state(CFG, seed=123), CFG, tmp_path / "served", tokenizer=False)
    server = local_fake_server(str(served), group_timeout_s=120, receiver_device="cuda:1")
    learner = _bf16_state("cuda:0")
    with ServerThread(server.app) as url:
        cfg = SGLangSamplerConfig(
            urls=(url,), weight_transport="distributed", group_backend="nccl", master_port=free_port(),
            group_timeout_s=120.0, bucket_mb=1 / 16, export_dtype="bfloat16",
        )  # fmt: skip
        async with make_sglang_sampler(cfg, CFG) as sampler:
            await sampler.update_weights(learner, 1)
            assert sampler.stats["buckets_sent"] > 1 and sampler.stats["groups_built"] == 1
    assert server.weights.skipped == []
    sent = {name: getattr(torch, dtype) for name, dtype, _shape in server.received}
    assert set(sent.values()) == {torch.bfloat16}
    expected = hf_weights(learner, CFG)
    held = server.weights.hf_state()
    assert all(torch.equal(held[k].to(torch.bfloat16).cpu(), v.cpu()) for k, v in expected.items())
