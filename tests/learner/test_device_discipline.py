"""Device discipline, checked on CPU: what would break on CUDA shows up here.

A ``TorchFunctionMode`` watches every torch call made *directly* from labrl's
learner, local sampler, objectives, models and rollout code (the calling
frame decides: megatron-core's and torch's own calls, e.g. AdamW's, are not
ours to police). Torch function modes are per thread, so the sampler's forward
threads enter the mode too:

- a tensor factory (``zeros``, ``arange``, ``full``, ``tensor``, ``randint``,
  ...) must name its ``device`` explicitly, equal to the model's device or the
  deliberate host marker ``labrl.harness.models.device.HOST`` (host-side
  buffers that are copied to the device once). On a CPU machine a forgotten
  ``device=`` is harmless, which is why the rule is "explicit", not "equal":
  on CUDA the same call builds a CPU tensor and the forward fails with
  "Expected all tensors to be on the same device".
- host-device copies (``.cpu()``, ``.to()``, ``.item()``, ``int()``,
  ``.tolist()``, ``.numpy()``, ...) on tensors that are not known host tensors
  are counted. Host tensors: results of such a copy, factories with
  ``device=HOST``, the collated ``TrainBatch`` (built on the host by
  ``labrl.harness.rollout.batching``, the intended pattern) until its upload
  (``batching.to_device``, which on CPU hands back the same tensors: from then on
  they stand for device tensors) and whatever is computed only from host tensors. The sampler may copy at most 3 times per forward
  (logits down, fed tokens up, routing down) whatever the batch size; the
  learner a bounded number of times per train step, not once per parameter
  nor once per micro-batch.
"""

from __future__ import annotations

import asyncio
import math
import sys
import weakref

import pytest
import torch
import torch.utils._pytree
from rollout_builders import as_trajectories, random_requests
from torch.overrides import TorchFunctionMode
from torch_modes import op_name, to_device, to_host

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import get_preset
from labrl.harness.objectives import M2PO, TIS, ObjectiveConfig
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig

try:  # the host marker; absent before device discipline existed
    from labrl.harness.models.device import HOST
except ImportError:  # pragma: no cover - lets this test report violations on old code
    HOST = object()

WATCHED = (
    "labrl.harness.learners",
    "labrl.harness.samplers.local",
    "labrl.harness.objectives",
    "labrl.harness.models",
    "labrl.harness.rollout.play",
)
FACTORIES = {
    "zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "randint", "rand", "randn",
    "randperm", "linspace", "eye", "from_numpy", "empty_strided", "scalar_tensor",
}  # fmt: skip
COPIES = {"cpu", "cuda", "to", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"}
UPLOAD = "labrl.harness.rollout.batching"  # `to_device`: a train batch's one host-to-device copy
# 2 MoE layers of 8 experts: > 30 parameter tensors, few enough torch calls to audit every one quickly
TINY = get_preset("tiny-moe").model_copy(
    update={"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "moe_ffn_hidden_size": 64}
)


# torch's thin Python wrappers around tensor methods and functions: their caller made the call
WRAPPERS = (
    "torch._tensor",
    "torch.functional",
    "torch.overrides",
    "torch.utils._device",
    "torch._jit_internal",
)


def _caller_module() -> tuple[str, str]:
    """The module that made this torch call: torch's own calls (an optimizer's, a loss's) are not ours."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(WRAPPERS) or name == __name__):
            return name, f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "", ""


class DeviceAudit(TorchFunctionMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._host: dict[int, weakref.ref] = {}  # id -> tensor (tensors compare elementwise: no set)
        self.violations: list[str] = []
        self.copies: dict[str, int] = {}
        self.copy_sites: dict[str, int] = {}  # "file:line method" -> count, for the failure message

    def mark_host(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = weakref.ref(t)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def copies_from(self, prefix: str) -> int:
        return sum(n for module, n in self.copies.items() if module.startswith(prefix))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        module, where = _caller_module()
        watched = module.startswith(WATCHED)
        out = func(*args, **kwargs)
        if module == UPLOAD and name == "to" and to_device(args, kwargs) == self.device:
            # the train step's one upload: on a CPU machine `.to(cpu)` hands back the host tensor itself,
            # which from here on stands for the device tensor it is on CUDA (reads of it are copies)
            self._host.pop(id(out), None)
            return out
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        all_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        if watched and name in FACTORIES:
            device = kwargs.get("device")
            if name == "from_numpy" or device is None:
                self.violations.append(f"{where} torch.{name} without device=")
            elif device is HOST:
                self.mark_host(out)
            elif torch.device(device) != self.device:
                self.violations.append(f"{where} torch.{name}(device={device}) != model {self.device}")
        elif watched and name in COPIES and not (name == "to" and to_device(args, kwargs) is None):
            # (a dtype cast, `.to(torch.float32)`, moves nothing between host and device)
            downloads_host = all_host and name != "to" and name != "cuda"
            if not downloads_host:
                self.copies[module] = self.copies.get(module, 0) + 1
                self.copy_sites[f"{where} {name}"] = self.copy_sites.get(f"{where} {name}", 0) + 1
            if name in ("cpu", "numpy") or (name == "to" and to_host(args, kwargs)):
                self.mark_host(out)
        elif all_host:
            for t in out if isinstance(out, tuple | list) else (out,):
                self.mark_host(t)
        return out


def _audit_worker_threads(monkeypatch, audit: DeviceAudit) -> None:
    """Torch function modes are per thread: enter ``audit`` in the sampler's forward threads too."""
    real = asyncio.to_thread

    async def to_thread(fn, /, *args, **kwargs):
        def run():
            with audit:
                return fn(*args, **kwargs)

        return await real(run)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@pytest.fixture(scope="module")
def learner() -> MegatronLearner:
    return MegatronLearner(LearnerConfig(model=TINY, micro_batch_size=2))


@pytest.mark.parametrize("scheduling", ["continuous", "waves"])
def test_sampler_and_learner_keep_to_the_model_device(learner, scheduling, monkeypatch):
    sampler = LocalSampler(
        TINY, LocalSamplerConfig(scheduling=scheduling), weights=learner.export_weights(), version=0
    )
    reqs = random_requests(4, prompt_len=10, max_new=6)
    audit = DeviceAudit(_model_device(sampler.model))
    steps_before, batches_before = sampler.decode_steps, sampler.stats["batches"]
    merges_before = sampler.stats.get("cache_merges", 0)
    _audit_worker_threads(monkeypatch, audit)
    with audit:
        results = asyncio.run(sampler.generate(reqs))
    admissions = sampler.stats["batches"] - batches_before
    caches = admissions + sampler.stats.get("cache_merges", 0) - merges_before
    forwards = sampler.decode_steps - steps_before + admissions
    sampler_copies = audit.copies_from("labrl.harness.samplers")
    assert all(r.routed_experts_T_L_K is not None for r in results)
    assert not audit.violations, (
        f"{len(audit.violations)} factory calls off the model device: {audit.violations[:8]}"
    )
    # per forward: tokens up, logits down, routing down; per new cache: its mask or row starts up;
    # never once per row
    assert forwards > 4 and sampler_copies <= 3 * forwards + 2 * caches, (
        sampler_copies,
        forwards,
        audit.copy_sites,
    )

    if scheduling == "waves":
        return  # the learner's part needs one sampled batch, not one per scheduling
    batch = collate(as_trajectories(reqs, results, group_size=2), pad_token_id=0)
    plain = batch.__class__(**{**batch.__dict__, "routed_experts_B_T_L_K": None})
    n_params = len(list(learner.model.parameters()))
    for b, replayed in ((plain, False), (batch, True)):
        audit = DeviceAudit(_model_device(learner.model))
        audit.mark_host(*(v for v in b.__dict__.values() if isinstance(v, torch.Tensor)))
        with audit:
            metrics = learner.train_step(b)
        assert metrics["learner/router_replay"] == float(replayed)
        assert not audit.violations, (
            f"{len(audit.violations)} factory calls off the model device: {audit.violations[:8]}"
        )
        # the batch is uploaded once (one copy per field) and the grad norm read once, not per parameter
        learner_copies = audit.copies_from("labrl.harness.learners")
        learner_sites = {k: v for k, v in audit.copy_sites.items() if k.startswith("megatron.py")}
        # (more parameter tensors than the bound: one read per parameter would exceed it)
        bound = 16
        assert n_params > bound and learner_copies <= bound, (n_params, learner_copies, learner_sites)


@pytest.mark.parametrize(
    ("objective", "graph_memory_fraction", "separate", "bound"),
    [
        # each micro-batch's pi_prox from its own forward
        (ObjectiveConfig(corrections=[TIS(c=2.0)]), 0.5, 0.0, 4),
        # M2PO: kept loss-forward graphs, the proximal check read before the backward passes
        (ObjectiveConfig(corrections=[TIS(c=2.0), M2PO(tau=1.0)]), 0.5, 0.0, 5),
        # M2PO: the no-grad forward first
        (ObjectiveConfig(corrections=[TIS(c=2.0), M2PO(tau=1.0)]), 0.0, 1.0, 5),
    ],
    ids=["one-forward", "kept-graphs", "separate-forward"],
)
def test_the_learners_host_copies_do_not_grow_with_the_micro_batches(
    objective, graph_memory_fraction, separate, bound
):
    """A host copy waits for the device; one per micro-batch leaves a GPU idle while the host queues the
    next. Every check, loss and metric of a step is read once, after the last backward."""
    reqs = random_requests(8, prompt_len=10, max_new=6, seed=5)
    copies, sites = {}, {}
    for micro_batch_size in (4, 2, 1):  # 2, 4 and 8 micro-batches of one 8-row batch
        learner = MegatronLearner(
            LearnerConfig(
                model=TINY,
                micro_batch_size=micro_batch_size,
                objective=objective,
                graph_memory_fraction=graph_memory_fraction,
            )
        )
        sampler = LocalSampler(TINY, LocalSamplerConfig(), weights=learner.export_weights(), version=0)
        results = asyncio.run(sampler.generate(reqs))
        batch = collate(as_trajectories(reqs, results, group_size=2), pad_token_id=0)
        audit = DeviceAudit(_model_device(learner.model))
        audit.mark_host(*(v for v in batch.__dict__.values() if isinstance(v, torch.Tensor)))
        with audit:
            metrics = learner.train_step(batch)
        assert metrics["learner/optimizer_steps"] == 1.0 and metrics["learner/proximal_forward"] == separate
        assert math.isfinite(metrics["loss/total"]) and 0.0 <= metrics["policy/clip_frac"] <= 1.0
        n = 8 // micro_batch_size
        copies[n] = audit.copies_from("labrl.harness.learners") + audit.copies_from(
            "labrl.harness.objectives"
        )
        sites[n] = {k: v for k, v in audit.copy_sites.items() if v >= n}  # the sites that may scale
    assert copies[2] == copies[4] == copies[8], (copies, sites[8])
    # and few: the batch terms (valid mask, counts, advantages, staleness) are computed on the host copy
    # before the upload and uploaded (2 copies); `prepare`'s diagnostics are one read (M2PO's mask
    # none), the step's checks, grad norm and metrics one more; a separate forward or kept graphs add
    # the proximal log-probs' check before the backward passes: 4 a step with the one forward, 5 with
    # the others (62-74 for 2-8 micro-batches on 2026-11-27, then 14, then 9 and 11)
    assert copies[8] <= bound, (copies, audit.copy_sites)
