"""Learner speed on CUDA, and the cost of padding ragged RL batches (CPU part).

GPU part (skipped cleanly without CUDA), for two shapes: the quickstart's tiny
MoE and a 64-expert top-8 MoE, 4 layers, hidden 2048, expert FFN 1024, vocab
32000 (~1.9B parameters, ~0.4B active), bf16:

- ``labrl``: ``MegatronLearner.train_step`` (old log-probs pass, forward,
  backward, fp32-master AdamW) on a full batch of B x T tokens;
- ``megatron``: bare megatron-core, same model builder (same spec), same
  micro-batch and sequence length: forward, cross-entropy, backward, AdamW
  on the bf16 parameters; once with the build's attention (``SDPAttention``
  without TE) and once with megatron's unfused ``DotProductAttention``; and
  once more with ``TorchGroupedMLP`` under labrl's precision policy (fp32 master
  weights and AdamW moments, fp32 gradient accumulation: ``adamw_with_precision``),
  so that ``vs_same_precision`` separates the harness's own cost in
  ``train_step`` from the cost of its mixed precision;
- ``hf``: transformers' ``Qwen3MoeForCausalLM`` in bf16 with
  ``experts_implementation="grouped_mm"`` (what a TRL/FSDP user trains), same
  shape, forward + backward + AdamW.

``labrl`` and ``megatron`` run once per experts module (``learner.experts``):
``SequentialMLP`` (one expert after another: the rows measured before
``TorchGroupedMLP``) and ``TorchGroupedMLP`` (all experts in one
``torch.nn.functional.grouped_mm``, what ``auto`` picks on CUDA in bf16); the
``labrl`` rows run in bf16 like the others. ``vs_same_experts`` is labrl over
bare megatron-core with the same experts module.

Per row: tokens/s (the median of ``--repeats`` timed windows of at least 0.25 s each, with their
spread: ``benchmarks/_timing.py``), model TFLOP/s and MFU against the device's dense bf16 peak
(FLOPs per token = 6 * active matmul parameters + 6 * layers * hidden * T for
causal attention, the same count for every path; ``labrl``'s default objective
takes the old log-probs from the loss forward, so it runs no extra forward:
its row also times ``learner.proximal_forward=separate``, the no-grad forward
first as before issue 26, for the ratio in the same run), and peak memory.
Plus the local sampler's decode tokens/s with either engine (``sampler.local.engine``:
megatron, static) at batch 32, 64 and 256 on both shapes, beside the HBM-bandwidth
floor (``decode_bytes_per_step``), and core attention alone, unfused vs SDPA, for
training, prefill and decode (``benchmarks/attention_sdpa.py``). ``--sampler-cpu``
runs both engines on the CPU (tiny model, fp32, eager) in one run.

CPU part (``--cpu``; ``--timed`` adds learner step times): padding fraction
and useful (non-padding) tokens/s of a learner step on batches whose lengths
follow real runs: episodes of the
quickstart env, the XRD tools env and the lab env, played with their gold
(else random) policy and with their random policy, measured in byte-tokenizer tokens of the whole
conversation. Padded to the batch's longest row vs length-sorted micro-batches
(``labrl.harness.rollout.batching.micro_batches``), in the same run.

    .venv/bin/python benchmarks/gpu_learner.py --cpu          # CPU part (~5 min on 2 cores)
    .venv/bin/python benchmarks/gpu_learner.py --sampler-cpu  # both sampler engines on the CPU (~20 s)
    python3 benchmarks/gpu_learner.py                         # on a GPU node (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import random
import statistics
import time
from pathlib import Path

import torch
from _quickstart import quickstart_learner_fields  # beside this script
from _results import RESULTS  # beside this script
from _timing import Timing, windowed  # beside this script
from attention_sdpa import core_attention_rows, print_rows  # beside this script

from labrl._warnings import quiet_expected_warnings
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import MoEModelConfig, get_preset
from labrl.harness.rollout.batching import collate
from labrl.harness.types import Trajectory

QUICKSTART_MODEL = get_preset("tiny-moe").model_copy(
    update={
        "max_sequence_length": 256,
        "num_layers": 2,
        "hidden_size": 96,
        "ffn_hidden_size": 192,
        "num_experts": 4,
        "moe_ffn_hidden_size": 192,
    }
)
BIG_MODEL = MoEModelConfig(
    name="moe-64x-top8-h2048",
    num_layers=4,
    hidden_size=2048,
    num_attention_heads=16,
    ffn_hidden_size=8192,
    num_experts=64,
    moe_router_topk=8,
    moe_ffn_hidden_size=1024,
    vocab_size=32000,
    max_sequence_length=4096,
)
# dense bf16 peaks (no sparsity), by device-name fragment
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
ENVS = {
    "quickstart (xrd/phase-id-v0)": (
        "xrd/phase-id-v0",
        {"tier": 1, "n_peaks": 6, "n_candidates": 4, "phase_pool": 8, "answer_format": "formula"},
    ),
    "xrd/phase-id-tools-v0": ("xrd/phase-id-tools-v0", {}),
    "lab/synthesis-multiturn-v0": ("lab/synthesis-multiturn-v0", {}),
}


# -- FLOPs ----------------------------------------------------------------------


def active_matmul_params(cfg: MoEModelConfig) -> int:
    """Parameters each token multiplies through (``MoEModelConfig.active_matmul_parameter_count``)."""
    return cfg.active_matmul_parameter_count


def train_flops_per_token(cfg: MoEModelConfig, T: int) -> float:
    return 6.0 * active_matmul_params(cfg) + 6.0 * cfg.num_layers * cfg.hidden_size * T


def peak_tflops() -> float | None:
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


# -- GPU part -------------------------------------------------------------------


def synthetic_batch(cfg: MoEModelConfig, B: int, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for b in range(B):
        tokens = torch.randint(0, min(cfg.vocab_size, 256), (T,), generator=gen).tolist()
        trajs.append(
            Trajectory(
                env_id="bench/synthetic", task_id=f"t{b}", group_id=f"g{b // 8}", tokens_T=tokens,
                loss_mask_T=[0] * (T // 2) + [1] * (T - T // 2), logprobs_T=[-1.0] * T, versions_T=[0] * T,
                reward=float(b % 2), outcome="ok", finish_reason="stop", num_turns=1,
            )
        )  # fmt: skip
    return collate(trajs, pad_token_id=0)


def free_cuda() -> None:
    """Release the previous path's memory before the next one is built and measured.

    Models hold reference cycles (hooks, closures), so dropping the last name is not enough:
    without the collection the 64-expert learner's 37 GiB outlived its row and every later
    row ran out of memory (H100, 2026-11-27)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def cuda_timed(fn, windows: int) -> Timing:
    """``fn``'s seconds per call on CUDA: the median of ``windows`` timed windows (``_timing.windowed``)."""
    return windowed(fn, torch.cuda.synchronize, windows=windows)


def row(name: str, cfg: MoEModelConfig, tokens: int, timing: Timing, T: int, peak: float | None) -> dict:
    seconds = timing.seconds
    tflops = train_flops_per_token(cfg, T) * tokens / seconds / 1e12
    return timing.as_row() | {
        "path": name,
        "tokens_per_s": tokens / seconds,
        "model_tflops": tflops,
        "mfu": None if peak is None else tflops / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


EXPERTS = {"sequential": "SequentialMLP", "grouped_mm": "TorchGroupedMLP"}


def timed_train_step(config: LearnerConfig, batch, repeats: int) -> tuple[Timing, MegatronLearner]:
    """``train_step``'s timing for a fresh learner on ``batch``, and the learner (for its spec)."""
    learner = MegatronLearner(config)
    return cuda_timed(lambda: learner.train_step(batch), repeats), learner


def vs_separate_forward(config: LearnerConfig, update: dict, batch, repeats: int, timing: Timing) -> dict:
    """The same learner with ``update`` (the separate no-grad proximal forward), timed on ``batch``:
    its tokens/s and ``timing``'s speed-up over it."""
    before, _ = timed_train_step(config.model_copy(update=update), batch, repeats)
    tokens = batch.tokens_B_T.numel()
    return {
        "separate_proximal_forward_tokens_per_s": tokens / before.seconds,
        "vs_separate_proximal_forward": before.seconds / timing.seconds,
    }


def bench_labrl(cfg: MoEModelConfig, B: int, T: int, mbs: int, repeats: int, peak, experts: str) -> dict:
    free_cuda()
    config = LearnerConfig(
        model=cfg, micro_batch_size=mbs, router_replay=False, precision="bf16", experts=experts
    )
    batch = synthetic_batch(cfg, B, T)
    timing, learner = timed_train_step(config, batch, repeats)
    out = row(f"labrl MegatronLearner.train_step, {EXPERTS[experts]}", cfg, B * T, timing, T, peak)
    out["spec"] = learner.spec.name
    out["experts"] = learner.spec.experts.name
    del learner
    free_cuda()  # the first learner is gone before the second is built
    return out | vs_separate_forward(config, {"proximal_forward": "separate"}, batch, repeats, timing)


def bench_labrl_m2po(cfg: MoEModelConfig, B: int, T: int, mbs: int, repeats: int, peak, experts: str) -> dict:
    """``train_step`` under the quickstart configs' objective (CISPO, M2PO, KL to a frozen reference): the
    loss forwards keep their graphs (``learner.graph_memory_fraction``), against the separate no-grad
    forward (``learner.graph_memory_fraction=0``) in the same run. Its reference forward makes it no
    match for the bare rows: its ratio is ``vs_separate_proximal_forward``."""
    free_cuda()
    config = LearnerConfig(
        model=cfg, micro_batch_size=mbs, router_replay=False, precision="bf16", experts=experts,
        **quickstart_learner_fields(),
    )  # fmt: skip
    batch = synthetic_batch(cfg, B, T)
    timing, learner = timed_train_step(config, batch, repeats)
    kept = learner.train_step(batch)["learner/kept_graphs"]  # the path the timed steps took
    out = row(f"labrl MegatronLearner.train_step, {EXPERTS[experts]}, M2PO + KL", cfg, B * T, timing, T, peak)
    out["objective"] = "m2po_kl"
    out["kept_graphs"] = kept
    out["micro_batches"] = -(-B // mbs)
    del learner
    free_cuda()
    return out | vs_separate_forward(config, {"graph_memory_fraction": 0.0}, batch, repeats, timing)


def megatron_step(
    cfg: MoEModelConfig,
    B: int,
    T: int,
    mbs: int,
    experts: str = "sequential",
    attention: str = "auto",
    fp32_master: bool = False,
    device: torch.device | None = None,
):
    """Bare megatron-core's training step on a random (B, T) batch: ``(step, model)``.

    Micro-batches of ``mbs`` rows: forward, cross-entropy, backward; then AdamW on
    the bf16 parameters, or (``fp32_master``) under labrl's precision policy
    (``adamw_with_precision``) and nothing else of its learner."""
    from labrl.harness.learners.precision import adamw_with_precision
    from labrl.harness.models import build_gpt_model, causal_attention_mask

    device = torch.device("cuda") if device is None else device
    model = build_gpt_model(
        cfg, routing_replay=False, device=device, dtype=torch.bfloat16, experts=experts, attention=attention
    ).train()
    if fp32_master:  # labrl's precision policy (module docstring), nothing else of its learner
        opt, master = adamw_with_precision(list(model.parameters()), lr=1e-5)
        assert master is not None
    else:
        opt, master = torch.optim.AdamW(model.parameters(), lr=1e-5), None
    tokens = torch.randint(0, min(cfg.vocab_size, 256), (B, T), device=device)
    positions = torch.arange(T, device=device).expand(mbs, T)
    mask = causal_attention_mask(T, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for start in range(0, B, mbs):
            chunk = tokens[start : start + mbs]
            logits = model(input_ids=chunk, position_ids=positions[: chunk.shape[0]], attention_mask=mask)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1)
            )
            loss.backward()
            if master is not None:
                master.accumulate_grads()
        opt.step()
        if master is not None:
            master.copy_to_model()

    return step, model


def bench_megatron(
    cfg: MoEModelConfig,
    B: int,
    T: int,
    mbs: int,
    repeats: int,
    peak,
    experts: str = "sequential",
    attention: str = "auto",
    fp32_master: bool = False,
) -> dict:
    free_cuda()
    step, model = megatron_step(cfg, B, T, mbs, experts, attention, fp32_master)
    timing = cuda_timed(step, repeats)
    name = (
        f"bare megatron-core, {EXPERTS[experts]}"
        + (", unfused attention" if attention == "unfused" else "")
        + (", fp32 master" if fp32_master else "")
    )
    out = row(name, cfg, B * T, timing, T, peak)
    out["experts"] = EXPERTS[experts]
    out["fp32_master"] = fp32_master
    out["attention"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
    return out


def bench_megatron_unfused(
    cfg: MoEModelConfig, B: int, T: int, mbs: int, repeats: int, peak, experts: str
) -> dict:
    """The bare megatron-core row with megatron's unfused DotProductAttention (the spec before SDPA)."""
    return bench_megatron(cfg, B, T, mbs, repeats, peak, experts, attention="unfused")


def bench_megatron_master(
    cfg: MoEModelConfig, B: int, T: int, mbs: int, repeats: int, peak, experts: str
) -> dict:
    """The bare megatron-core row under labrl's precision policy (fp32 master weights and moments)."""
    return bench_megatron(cfg, B, T, mbs, repeats, peak, experts, fp32_master=True)


def bench_hf(cfg: MoEModelConfig, B: int, T: int, mbs: int, repeats: int, peak) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    free_cuda()
    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk, decoder_sparse_step=1,
        max_position_embeddings=cfg.max_sequence_length, norm_topk_prob=True, output_router_logits=False,
    )  # fmt: skip
    try:
        hf_cfg.experts_implementation = "grouped_mm"
    except (AttributeError, ValueError):
        pass
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(hf_cfg).to(torch.bfloat16).train()
    implementation = getattr(model.config, "experts_implementation", None) or "default"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, min(cfg.vocab_size, 256), (B, T), device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for start in range(0, B, mbs):
            chunk = tokens[start : start + mbs]
            model(input_ids=chunk, labels=chunk).loss.backward()
        opt.step()

    timing = cuda_timed(step, repeats)
    out = row(f"HF Qwen3MoeForCausalLM ({implementation})", cfg, B * T, timing, T, peak)
    return out


# HBM bandwidth in bytes/s, by device-name fragment (SXM parts; the decode floor's denominator)
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10": 0.6e12}
SAMPLER_BATCHES = (32, 64, 256)


def hbm_bytes_per_s() -> float | None:
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)


def decode_bytes_per_step(cfg: MoEModelConfig, batch: int, context: int, itemsize: int = 2) -> float:
    """Bytes one decode step must read at least: the weights it touches and the KV cache it attends over.

    With ``E`` experts, top-``K`` routing and ``B`` rows, the experts one MoE layer touches are
    ``E * (1 - (1 - K/E)^B)`` in expectation (uniform routing)::

        bytes = itemsize * (all parameters - expert parameters
                            + moe_layers * touched * 3 * hidden * moe_ffn
                            + layers * 2 * B * context * groups * head_dim)

    The HBM floor of a step is ``bytes / bandwidth``; no engine decodes faster than
    ``B / floor`` tokens/s.
    """
    E, K = cfg.num_experts, cfg.moe_router_topk
    expert = 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size
    touched = E * (1 - (1 - K / E) ** batch)
    head = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups or cfg.num_attention_heads
    weights = cfg.parameter_count - cfg.num_moe_layers * E * expert + cfg.num_moe_layers * touched * expert
    kv = cfg.num_layers * 2 * batch * context * groups * head
    return itemsize * (weights + kv)


def bench_sampler(
    cfg: MoEModelConfig, batch: int, prompt: int, new: int, engine: str, device: str = "cuda"
) -> dict:
    """Decode tokens/s of one wave of ``batch`` requests (seeded, temperature 1), after a warm-up wave
    of the same shape (2 new tokens: the static engine's same batch and cache buckets, graphs captured).
    Both engines in bf16 on CUDA (the tiny model too, whose ``auto`` is fp32), fp32 on the CPU."""
    from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
    from labrl.harness.types import GenerateRequest, SamplingParams

    precision = "bf16" if device.startswith("cuda") else "fp32"  # bf16 on CUDA: the static engine's graphs
    if device.startswith("cuda"):
        free_cuda()
    config = LocalSamplerConfig(
        max_batch_size=batch, device=device, engine=engine, scheduling="waves", precision=precision
    )
    sampler = LocalSampler(cfg, config)
    gen = torch.Generator().manual_seed(0)

    def requests(max_new: int) -> list[GenerateRequest]:
        return [
            GenerateRequest(
                rid=f"r{i}",
                input_ids=tuple(
                    torch.randint(0, min(cfg.vocab_size, 256), (prompt,), generator=gen).tolist()
                ),
                sampling=SamplingParams(max_new_tokens=max_new, seed=i, stop_token_ids=()),
            )
            for i in range(batch)
        ]

    cuda = device.startswith("cuda")
    asyncio.run(sampler.generate(requests(2)))  # warm-up
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = asyncio.run(sampler.generate(requests(new)))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    generated = sum(len(r.output_ids) for r in results)
    return {"path": f"LocalSampler decode, engine={engine}", "engine": engine, "model": cfg.name, "batch": batch,
            "precision": precision, "prompt": prompt, "new_tokens": new,
            "tokens_per_s": generated / seconds}  # fmt: skip


def sampler_rows(cfg: MoEModelConfig, prompt: int, new: int, bandwidth: float | None):
    """Both engines at every batch of ``SAMPLER_BATCHES``, the HBM floor beside them (bf16 bytes);
    yields each row as it is measured (the static row once its ratio to the megatron one is known)."""
    for batch in SAMPLER_BATCHES:
        floor_s = (
            None if bandwidth is None else decode_bytes_per_step(cfg, batch, prompt + new // 2) / bandwidth
        )
        by_engine = {}
        for engine in ("megatron", "static"):
            try:
                r = bench_sampler(cfg, batch, prompt, new, engine)
            except Exception as exc:  # one engine failing must not hide the other's numbers
                r = {"path": f"LocalSampler decode, engine={engine}", "engine": engine, "model": cfg.name,
                     "batch": batch, "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
            r["hbm_floor_tokens_per_s"] = None if floor_s is None else batch / floor_s
            by_engine[engine] = r
        if all(r.get("tokens_per_s") for r in by_engine.values()):
            by_engine["static"]["vs_megatron"] = (
                by_engine["static"]["tokens_per_s"] / by_engine["megatron"]["tokens_per_s"]
            )
        yield from by_engine.values()


def sampler_cpu_part(batches: tuple[int, ...], prompt: int, new: int) -> dict:
    """Both engines on the quickstart's tiny model on the CPU (fp32, eager), one run."""
    rows = []
    for batch in batches:
        pair = {
            e: bench_sampler(QUICKSTART_MODEL, batch, prompt, new, e, device="cpu")
            for e in ("megatron", "static")
        }
        pair["static"]["vs_megatron"] = pair["static"]["tokens_per_s"] / pair["megatron"]["tokens_per_s"]
        rows += pair.values()
    return {"threads": torch.get_num_threads(), "rows": rows}


GPU_PARTS = ("learner", "sampler", "attention")


def gpu_part(repeats: int, parts: tuple[str, ...] = GPU_PARTS, save=lambda out: None) -> dict:
    """The GPU rows of ``parts``; ``save(out)`` after every row, so a run stopped by its time limit
    keeps what it measured (a lease is short and the 64-expert rows take minutes)."""
    peak = peak_tflops()
    out: dict = {"device": torch.cuda.get_device_name(0), "bf16_peak_tflops": peak, "shapes": {},
                 "sampler": [], "core_attention": []}  # fmt: skip
    for cfg, B, T, mbs in (
        ((QUICKSTART_MODEL, 64, 200, 32), (BIG_MODEL, 16, 2048, 2)) if "learner" in parts else ()
    ):
        rows: list[dict] = []
        out["shapes"][cfg.name] = {"B": B, "T": T, "micro_batch": mbs,
                                   "active_matmul_params": active_matmul_params(cfg), "rows": rows}  # fmt: skip
        benches = [
            (bench_megatron, "sequential"), (bench_labrl, "sequential"), (bench_hf, None),
            (bench_megatron, "grouped_mm"), (bench_labrl, "grouped_mm"), (bench_megatron_unfused, "sequential"),
            (bench_megatron_master, "grouped_mm"), (bench_labrl_m2po, "grouped_mm"),
        ]  # fmt: skip
        for bench, experts in benches:
            args = (cfg, B, T, mbs, repeats, peak) + ((experts,) if experts else ())
            try:
                rows.append(bench(*args))
            except Exception as exc:  # one path failing must not hide the others' numbers
                rows.append(
                    {"path": f"{bench.__name__} {experts or ''}", "error": f"{type(exc).__name__}: {exc}"}
                )
            print(f"  {cfg.name}: {learner_row_line(rows[-1])}", flush=True)
            save(out)
        base = rows[0].get("tokens_per_s")  # bare megatron-core with SequentialMLP
        bare = {  # the SDPA rows: the unfused one is attention's own comparison
            r["experts"]: r["tokens_per_s"]
            for r in rows
            if r["path"].startswith("bare")
            and "experts" in r
            and "unfused" not in r["path"]
            and not r.get("fp32_master")
        }
        same_precision = {r["experts"]: r["tokens_per_s"] for r in rows if r.get("fp32_master")}
        for r in rows:
            if r.get("objective"):  # another objective: compared with its own separate forward only
                continue
            if base and "tokens_per_s" in r:
                r["vs_bare_megatron"] = r["tokens_per_s"] / base
            if r["path"].startswith("labrl") and r.get("experts") in bare:
                r["vs_same_experts"] = r["tokens_per_s"] / bare[r["experts"]]
            if r["path"].startswith("labrl") and r.get("experts") in same_precision:
                r["vs_same_precision"] = r["tokens_per_s"] / same_precision[r["experts"]]
        save(out)
    bandwidth = hbm_bytes_per_s()
    out["hbm_bytes_per_s"] = bandwidth
    if "sampler" in parts:
        for cfg, prompt in ((QUICKSTART_MODEL, 160), (BIG_MODEL, 512)):
            for r in sampler_rows(cfg, prompt, 64, bandwidth):
                out["sampler"].append(r)
                print_sampler_rows([r], header=False)
                save(out)
    for cfg, train, prefill, decode_batch in ((QUICKSTART_MODEL, (32, 200), (64, 160), 64),
                                              (BIG_MODEL, (2, 2048), (32, 512), 32)) if "attention" in parts else ():  # fmt: skip
        try:
            out["core_attention"] += core_attention_rows(
                cfg,
                train,
                prefill,
                decode_batch,
                device=torch.device("cuda"),
                dtype=torch.bfloat16,
                repeats=repeats,
            )
        except Exception as exc:
            out["core_attention"].append({"attention": cfg.name, "error": f"{type(exc).__name__}: {exc}"})
        save(out)
    return out


# -- CPU part: padding on ragged batches -------------------------------------------


async def episode_lengths(env_id: str, options: dict, n: int, policy_name: str) -> list[int]:
    """Tokens of whole conversations (byte tokenizer) played with the env's gold (else random) or random policy."""
    from labrl.envs.episode import run_episode, scripted_policy
    from labrl.envs.registry import make
    from labrl.harness.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    async def one(i: int) -> int:
        env = make(env_id, **options)
        try:
            task = env.make_task("train", i)
            gold = env.gold_actions(task) if policy_name == "gold" else None
            rng = random.Random(i)

            async def random_policy(messages, tools):
                return env.random_action(task, rng)

            policy = scripted_policy(list(gold)) if gold is not None else random_policy
            episode = await run_episode(env, task, policy)
            return len(tok.chat_prompt(episode.messages, ()))
        finally:
            await env.close()

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def ragged_batch(lengths: list[int], vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for b, n in enumerate(lengths):
        tokens = torch.randint(0, min(vocab, 256), (n,), generator=gen).tolist()
        gen_len = max(1, min(32, n // 4))
        trajs.append(
            Trajectory(
                env_id="bench/ragged", task_id=f"t{b}", group_id=f"g{b // 8}", tokens_T=tokens,
                loss_mask_T=[0] * (n - gen_len) + [1] * gen_len, logprobs_T=[-1.0] * n, versions_T=[0] * n,
                reward=float(b % 2), outcome="ok", finish_reason="stop", num_turns=1,
            )
        )  # fmt: skip
    return collate(trajs, pad_token_id=0)


def padded_tokens(lengths: list[int], mbs: int, sort: bool) -> int:
    from labrl.harness.rollout.batching import micro_batches

    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    _, spans = micro_batches(mask, mbs, sort_by_length=sort)
    return sum((stop - start) * T for start, stop, T in spans)


def cpu_part(n_episodes: int, batch: int, repeats: int, timed: bool) -> dict:
    """Padding fractions on the envs' real lengths; with ``timed``, learner steps padded vs sorted.

    Padding is exact arithmetic on the sampled lengths (tokens computed per
    micro-batch plan). The timed comparison trains the quickstart model, so
    its lengths are capped at that model's 256-token context.
    """
    torch.set_num_threads(2)
    mbs = 16
    out: dict = {"batch": batch, "micro_batch": mbs, "model": QUICKSTART_MODEL.name, "envs": {}}
    for (env_label, (env_id, options)), policy_name in itertools.product(ENVS.items(), ("gold", "random")):
        label = f"{env_label}, {policy_name}"
        try:
            lengths = asyncio.run(episode_lengths(env_id, options, n_episodes, policy_name))
        except Exception as exc:
            out["envs"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        rng = random.Random(0)
        sample = [rng.choice(lengths) for _ in range(batch)]
        real = sum(sample)
        res: dict = {
            "episodes": len(lengths),
            "length_p50": statistics.median(lengths),
            "length_min": min(lengths),
            "length_max": max(lengths),
            "padded_padding_fraction": 1 - real / padded_tokens(sample, mbs, False),
            "sorted_padding_fraction": 1 - real / padded_tokens(sample, mbs, True),
        }
        res["sorted_compute_ratio"] = padded_tokens(sample, mbs, True) / padded_tokens(sample, mbs, False)
        if timed:
            res |= timed_steps(sample, mbs, repeats)
        out["envs"][label] = res
        print(label, json.dumps(res), flush=True)
    return out


def timed_steps(sample: list[int], mbs: int, repeats: int) -> dict:
    """Learner step time, padded vs length-sorted, interleaved (a shared machine's load hits both alike)."""
    cap = QUICKSTART_MODEL.max_sequence_length
    capped = [min(n, cap) for n in sample]
    real = sum(capped)
    b = ragged_batch(capped, QUICKSTART_MODEL.vocab_size, seed=1)
    learners, times = {}, {False: [], True: []}
    for sort in (False, True):
        learners[sort] = MegatronLearner(
            LearnerConfig(
                model=QUICKSTART_MODEL, micro_batch_size=mbs, router_replay=False,
                length_sorted_micro_batches=sort,
            )
        )  # fmt: skip
        learners[sort].train_step(b)  # warm-up
    for _ in range(repeats):
        for sort in (False, True):
            started = time.perf_counter()
            learners[sort].train_step(b)
            times[sort].append(time.perf_counter() - started)
    res = {"timed_cap": cap}
    for sort in (False, True):
        mode = "sorted" if sort else "padded"
        res[f"{mode}_step_s"] = statistics.median(times[sort])
        res[f"{mode}_useful_tokens_per_s"] = real / res[f"{mode}_step_s"]
    res["sorted_speedup"] = res["padded_step_s"] / res["sorted_step_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="the CPU part: padding on ragged batches")
    ap.add_argument("--timed", action="store_true", help="CPU part: also time learner steps padded vs sorted")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="GPU learner rows: timed windows, their median (benchmarks/_timing.py); elsewhere repetitions",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--sampler-cpu", action="store_true", help="both sampler engines on the tiny model, on the CPU"
    )
    ap.add_argument(
        "--parts", default=",".join(GPU_PARTS), help="GPU part: which of learner,sampler,attention to run"
    )
    args = ap.parse_args()
    parts = tuple(p for p in args.parts.split(",") if p)
    if unknown := set(parts) - set(GPU_PARTS):
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from {','.join(GPU_PARTS)}")
    quiet_expected_warnings()
    if args.sampler_cpu:
        torch.set_num_threads(2)
        result = {"sampler_cpu": sampler_cpu_part((8, 32), 160, 32)}
        out = args.out or RESULTS / "gpu_learner_sampler_cpu.json"
        print_sampler_rows(result["sampler_cpu"]["rows"])
    elif args.cpu:
        result = {"cpu": cpu_part(args.episodes, args.batch, args.repeats, args.timed)}
        out = args.out or RESULTS / "gpu_learner_cpu_padding.json"
        print_cpu_table(result["cpu"])
    else:
        if not torch.cuda.is_available():
            print("gpu_learner: no CUDA device here, skipping the GPU part (run with --cpu for the CPU part)")
            return
        out = args.out or RESULTS / "gpu_learner.json"
        out.parent.mkdir(parents=True, exist_ok=True)

        def save(partial: dict) -> None:
            out.write_text(json.dumps({"gpu": partial, "partial": True}, indent=1))

        result = {"gpu": gpu_part(args.repeats, parts, save)}
        print_gpu_table(result["gpu"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def print_cpu_table(res: dict) -> None:
    print(f"\nbatch {res['batch']} episodes, micro-batch {res['micro_batch']}")
    print(
        f"{'env, policy':40} {'tokens p50 [min,max]':>22} {'padding: padded':>16} {'sorted':>8} {'compute sorted/padded':>22}"
    )
    for label, r in res["envs"].items():
        if "error" in r:
            print(f"{label:40} error: {r['error']}")
            continue
        span = f"{r['length_p50']:.0f} [{r['length_min']},{r['length_max']}]"
        print(f"{label:40} {span:>22} {r['padded_padding_fraction']:>16.1%} {r['sorted_padding_fraction']:>8.1%} "
              f"{r['sorted_compute_ratio']:>22.2f}")  # fmt: skip
        if "sorted_speedup" in r:
            print(f"{'':40} timed at <= {r['timed_cap']} tokens: useful tok/s padded "
                  f"{r['padded_useful_tokens_per_s']:.0f}, sorted {r['sorted_useful_tokens_per_s']:.0f} "
                  f"({r['sorted_speedup']:.2f}x)")  # fmt: skip


def print_sampler_rows(rows: list[dict], header: bool = True) -> None:
    if header:
        print(
            f"\n{'sampler':42} {'model':22} {'batch':>5} {'tok/s':>9} {'static/megatron':>16} {'HBM floor tok/s':>16}"
        )
    for r in rows:
        floor = r.get("hbm_floor_tokens_per_s")
        floor_s = "-" if floor is None else f"{floor:.0f}"
        ratio = f"{r['vs_megatron']:.2f}x" if "vs_megatron" in r else ""
        speed = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else f"error: {r.get('error')}"
        print(f"{r['path']:42} {r['model']:22} {r['batch']:>5} {speed:>9} {ratio:>16} {floor_s:>16}")


def learner_row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['path']:55} error: {r['error']}"
    mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
    same = f"  same experts x{r['vs_same_experts']:.2f}" if "vs_same_experts" in r else ""
    if "vs_same_precision" in r:
        same += f"  same precision x{r['vs_same_precision']:.2f}"
    if "vs_separate_proximal_forward" in r:
        same += f"  vs separate forward x{r['vs_separate_proximal_forward']:.2f}"
    if "kept_graphs" in r:
        same += f"  kept graphs {r['kept_graphs']:.0f} of {r['micro_batches']}"
    spread = f" (spread {r['spread']:.0%})" if "spread" in r else ""
    bare = f"  x{r['vs_bare_megatron']:.2f}" if "vs_bare_megatron" in r else ""
    return (f"{r['path']:55} {r['tokens_per_s']:>10.0f} tok/s{spread} {r['model_tflops']:>7.1f} TFLOP/s "
            f"MFU {mfu:>6} peak {r['peak_mem_gib']:.1f} GiB{bare}{same}")  # fmt: skip


def print_gpu_table(res: dict) -> None:
    print(f"\n{res['device']}, bf16 peak {res['bf16_peak_tflops']} TFLOP/s")
    for name, shape in res["shapes"].items():
        print(f"\n{name}: B={shape['B']} T={shape['T']} micro-batch {shape['micro_batch']}")
        for r in shape["rows"]:
            print(f"  {learner_row_line(r)}")
    print_sampler_rows(res["sampler"])
    print("\ncore attention, bf16 (ratio = unfused / sdpa)")
    for r in res["core_attention"]:
        if "error" in r:
            print(f"  {r['attention']:44} error: {r['error']}")
    print_rows([r for r in res["core_attention"] if "error" not in r])


if __name__ == "__main__":
    main()
