"""Core attention: megatron's unfused ``DotProductAttention`` vs labrl's ``SDPAttention``, same run.

For a model shape, both modules on the same inputs, timed interleaved (a shared machine's load
hits both alike), median of ``--repeats``:

- ``train``: forward + backward over ``[T, B]`` with the learner's causal mask;
- ``prefill``: no-grad forward over ``[P, B]`` with the local sampler's prefill mask (prompts
  left-padded to P, lengths P/2..P; causal and padding);
- ``decode``: no-grad forward of one query per row against a key/value cache of ``P + 64``
  slots, with the sampler's padding mask.

And on the CPU (``--model``) the quickstart model built with each attention
(``build_gpt_model(attention=...)``): a learner micro-batch's forward + backward, and the local
sampler's prefill + KV-cache decode of one batch. ``ratio`` = unfused time / SDPA time (> 1:
SDPA faster). ``benchmarks/gpu_learner.py`` runs the same rows on CUDA in bf16.

    .venv/bin/python benchmarks/attention_sdpa.py --model     # CPU, fp32, 2 threads (~2 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from _results import RESULTS  # beside this script
from _timing import alternating, device_sync  # beside this script
from _torch_threads import parse_with_threads  # beside this script

from labrl._warnings import quiet_expected_warnings
from labrl.harness.models import MoEModelConfig, get_preset
from labrl.harness.models.build import build_gpt_model, causal_attention_mask, ensure_model_parallel
from labrl.harness.models.config import ParallelConfig

QUICKSTART_MODEL = get_preset("tiny-moe").model_copy(
    update={"max_sequence_length": 256, "num_layers": 2, "hidden_size": 96, "ffn_hidden_size": 192,
            "num_experts": 4, "moe_ffn_hidden_size": 192}
)  # fmt: skip
# attention of benchmarks/gpu_learner.py's 64-expert shape (16 heads of 128), and of Qwen3-30B-A3B (GQA 32/4)
BIG_ATTENTION = QUICKSTART_MODEL.model_copy(
    update={
        "name": "h2048-16x128",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "max_sequence_length": 4096,
    }
)
GQA_ATTENTION = QUICKSTART_MODEL.model_copy(
    update={"name": "qwen3-30b-attention (32 heads, 4 groups, 128)", "hidden_size": 2048,
            "num_attention_heads": 32, "num_query_groups": 4, "kv_channels": 128, "max_sequence_length": 4096}
)  # fmt: skip
# (shape, train B x T, prefill B x P, decode B): the quickstart's micro-batch and sampler batch; larger ones
CPU_SHAPES = ((QUICKSTART_MODEL, (32, 192), (64, 160), 64), (BIG_ATTENTION, (2, 1024), (8, 512), 32),
              (GQA_ATTENTION, (2, 1024), (8, 512), 32))  # fmt: skip


def core_attention_modules(cfg: MoEModelConfig, device: torch.device, dtype: torch.dtype):
    """(unfused, sdpa) core attention modules of ``cfg``'s attention, on ``device``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from labrl.harness.models.attention import SDPAttention

    ensure_model_parallel(ParallelConfig(), device)
    tconfig = cfg.transformer_config(ParallelConfig(), cpu=device.type != "cuda", dtype=dtype)
    return tuple(
        cls(tconfig, 1, AttnMaskType.causal, "self").to(device) for cls in (DotProductAttention, SDPAttention)
    )


def prefill_mask(B: int, P: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """The local sampler's prefill mask ``[B, 1, P, P]`` (True = blocked) for prompts of P/2..P tokens."""
    gen = torch.Generator().manual_seed(seed)
    start = P - torch.randint(P // 2, P + 1, (B,), generator=gen)
    keys = torch.arange(P)
    blocked = (keys[None, :] > keys[:, None])[None] | (keys[None, :] < start[:, None])[:, None, :]
    return blocked[:, None].to(device)


def timed_pair(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each function after one warm-up call each; calls interleaved, in alternating
    order (a shared machine's load, and whatever one call leaves in the caches, hit both alike)."""
    times = alternating(fns, device_sync(device), rounds=repeats, warmup=1)
    return {name: statistics.median(t) for name, t in times.items()}


def core_attention_rows(
    cfg: MoEModelConfig, train: tuple[int, int], prefill: tuple[int, int], decode_batch: int, *,
    device: torch.device, dtype: torch.dtype, repeats: int,
) -> list[dict]:  # fmt: skip
    """Rows ``{mode, shape, unfused_ms, sdpa_ms, ratio}`` for train, prefill and decode."""
    unfused, sdpa = core_attention_modules(cfg, device, dtype)
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    d = cfg.kv_channels or cfg.hidden_size // heads
    gen = torch.Generator(device=device).manual_seed(0)

    def qkv(sq: int, sk: int, b: int, grad: bool):
        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

        return rand(sq, b, heads, d), rand(sk, b, groups, d), rand(sk, b, groups, d)

    rows = []
    B, T = train
    q, k, v = qkv(T, T, B, grad=True)
    causal = causal_attention_mask(T, device=device)

    def train_step(module):
        def step():
            module(q, k, v, causal).float().square().mean().backward()

        return step

    B, P = prefill
    pq, pk, pv = qkv(P, P, B, grad=False)
    pmask = prefill_mask(B, P, device)
    S = P + 64
    dq, dk, dv = qkv(1, S, decode_batch, grad=False)
    dmask = ~torch.ones(decode_batch, 1, 1, S, dtype=torch.bool, device=device)
    dmask[:, :, :, : P // 4] = True  # left padding of the longest-padded rows

    cases = {
        "train": (f"B={train[0]} T={train[1]}", train_step(unfused), train_step(sdpa)),
        "prefill": (f"B={B} P={P}", lambda: unfused(pq, pk, pv, pmask), lambda: sdpa(pq, pk, pv, pmask)),
        "decode": (f"B={decode_batch} cache={S}", lambda: unfused(dq, dk, dv, dmask), lambda: sdpa(dq, dk, dv, dmask)),
    }  # fmt: skip
    for mode, (shape, slow, fast) in cases.items():
        with torch.no_grad() if mode != "train" else torch.enable_grad():
            t = timed_pair({"unfused": slow, "sdpa": fast}, repeats, device)
        rows.append({"attention": cfg.name, "mode": mode, "shape": shape, "heads": heads, "groups": groups,
                     "head_dim": d, "unfused_ms": 1e3 * t["unfused"], "sdpa_ms": 1e3 * t["sdpa"],
                     "ratio": t["unfused"] / t["sdpa"]})  # fmt: skip
    return rows


def model_rows(
    cfg: MoEModelConfig, B: int, T: int, generate: tuple[int, int, int], repeats: int
) -> list[dict]:
    """Whole model on the CPU, fp32, with each attention: a learner's forward + backward over [B, T], and
    the local sampler's work for ``generate = (batch, prompt, new tokens)``: a left-padded prefill and
    one KV-cache decode step per new token. Median seconds and ratio."""
    from megatron.core.inference.contexts import StaticInferenceContext

    models = {name: build_gpt_model(cfg, routing_replay=False, device="cpu", attention=name)
              for name in ("unfused", "sdpa")}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    mask = causal_attention_mask(T)
    GB, P, N = generate
    prompts = torch.randint(0, cfg.vocab_size, (GB, P), generator=gen)
    pmask = prefill_mask(GB, P, torch.device("cpu"))
    valid = ~pmask[:, 0, -1]  # [GB, P]: the keys the last prompt position may see

    def train(model):
        def run():
            model.train()
            positions = torch.arange(T).expand(B, T)
            model(input_ids=tokens, position_ids=positions, attention_mask=mask).float().mean().backward()

        return run

    def sample(model):
        def run():
            model.eval()
            ctx = StaticInferenceContext(GB, P + N)
            with torch.no_grad():
                logits = model(input_ids=prompts, position_ids=torch.arange(P).expand(GB, P),
                               attention_mask=pmask, inference_context=ctx, runtime_gather_output=True)  # fmt: skip
                ctx.sequence_len_offset += P
                for step in range(N - 1):
                    fed = logits[:, -1].argmax(-1, keepdim=True)
                    keys = torch.cat([valid, torch.ones(GB, step + 1, dtype=torch.bool)], dim=1)
                    positions = torch.full((GB, 1), P + step)
                    logits = model(input_ids=fed, position_ids=positions, attention_mask=~keys[:, None, None],
                                   inference_context=ctx, runtime_gather_output=True)  # fmt: skip
                    ctx.sequence_len_offset += 1

        return run

    rows = []
    for label, shape, make in (("learner fwd+bwd", f"B={B} T={T}", train),
                               ("sampler prefill+decode", f"B={GB} P={P} +{N}", sample)):  # fmt: skip
        t = timed_pair({name: make(m) for name, m in models.items()}, repeats, torch.device("cpu"))
        rows.append({"model": cfg.name, "work": label, "shape": shape, "unfused_s": t["unfused"],
                     "sdpa_s": t["sdpa"], "ratio": t["unfused"] / t["sdpa"]})  # fmt: skip
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"  {r['attention'][:44]:44} {r['mode']:8} {r['shape']:18} unfused {r['unfused_ms']:9.2f} ms  "
              f"sdpa {r['sdpa_ms']:9.2f} ms  x{r['ratio']:.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--model", action="store_true", help="also the whole quickstart model: learner and sampler"
    )
    ap.add_argument("--model-only", action="store_true", help="only the whole-model rows")
    ap.add_argument("--out", type=argparse.FileType("w"), default=None)
    args = parse_with_threads(ap, default=2)
    quiet_expected_warnings()
    device = torch.device("cpu")
    rows = []
    for cfg, train, prefill, decode_batch in () if args.model_only else CPU_SHAPES:
        rows += core_attention_rows(cfg, train, prefill, decode_batch, device=device, dtype=torch.float32,
                                    repeats=args.repeats)  # fmt: skip
    print(f"core attention, CPU fp32, {torch.get_num_threads()} threads (ratio = unfused / sdpa)")
    print_rows(rows)
    result: dict = {"device": "cpu", "threads": torch.get_num_threads(), "core_attention": rows}
    if args.model or args.model_only:
        # the quickstart's learner micro-batch, and its sampler batch (64 prompts, 6 new tokens)
        result["model"] = model_rows(QUICKSTART_MODEL, 32, 192, (64, 160, 6), args.repeats)
        for m in result["model"]:
            print(f"  whole model {m['model']} {m['work']:24} {m['shape']:16} unfused {m['unfused_s']:.3f} s  "
                  f"sdpa {m['sdpa_s']:.3f} s  x{m['ratio']:.2f}")  # fmt: skip
    out = args.out or (RESULTS / "attention_sdpa_cpu.json").open("w")
    json.dump(result, out, indent=1)
    print(f"wrote {out.name}")


if __name__ == "__main__":
    main()
