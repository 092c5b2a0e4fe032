"""MegatronLearner: trains a megatron-core MoE GPT with a labrl objective.

One ``train_step(batch)``::

    terms     = objectives.batch_terms(cfg, batch)  # on the host copy, before the upload: valid mask,
                                                  # advantages, their diagnostics (no launch, no device wait)
    old_B_T   = logprobs(model, batch)            # proximal policy: no grad, once, before any update
    prepared  = objectives.prepare(cfg, inputs, terms)  # IS weights/masks, denominator, mismatch diagnostics
    for epoch in range(epochs):                   # learner.epochs (default 1)
        for mb in split(rows, minibatches):       # learner.minibatches (default 1: the whole batch)
            for rows in micro-batches of mb:
                loss, m = objectives.policy_loss(cfg, logprobs(model, batch[rows]), prepared_mb[rows])
                loss.backward()                   # already divided by the mini-batch denominator
            clip global grad norm; AdamW step     # skipped if a loss or the grad norm is non-finite
    LR schedule step; version += 1                # once per batch: one new policy version

With one optimizer step per batch the first line is redundant where the
objective allows (``labrl.harness.learners.proximal`` decides, per batch): a
batch of one micro-batch, or an objective without whole-batch terms (no
M2PO), takes each micro-batch's ``old`` from its loss forward, detached
(``objectives.prepare_rows``), and runs ``objectives.prepare`` on the
filled-in ``old`` after the backward passes for the batch diagnostics. Under
a whole-batch term with several micro-batches, every loss forward runs first
and keeps its graph while memory allows (``labrl.harness.learners.graph_memory``),
``objectives.prepare`` sees the whole batch, then the backward passes run;
a micro-batch whose graph does not fit gets the no-grad forward. The metric
``learner/proximal_forward`` is the share of micro-batches that ran the
no-grad forward (1 under the separate forward), ``learner/kept_graphs`` the
number of kept graphs. Where every micro-batch's ``old`` is its own loss
forward (taken from it, or every graph kept), the ratio ``pi_theta / pi_prox``
is 1 on every token: the loss runs without the ratio and clip terms
(``policy_loss(..., proximal_is_current=True)``) and their metrics are the
constants they would sum to.

A batch's optimizer steps publish ONE new policy version (the orchestrator
pushes weights once per ``train_step``), so ``max_staleness`` and admission
count batches, not optimizer steps, and the LR schedule advances once per
batch. The proximal log-probs come from the weights of version ``v`` (the
batch start); steps after the first see ``pi_theta != pi_prox``, which is
what makes the objective's clip act (decoupled PPO, see
``labrl.harness.objectives._objective``). With several mini-batches the rows
are shuffled per epoch (seeded by the learner seed, batch and epoch).

Non-finite values: if the proximal log-probs are non-finite on a loss-mask
token the whole batch is skipped (without the separate forward: counted once
the last micro-batch's forward has filled them in, read with the step's other
checks after its backward, and the accumulated gradients dropped);
if a step's loss or gradient norm is non-finite that optimizer step is
skipped (gradients dropped, weights and optimizer state untouched). Skips
are counted in ``learner/skipped_steps`` and logged;
``learner.max_consecutive_skips`` skips in a row raise ``LearnerError``. A batch whose steps were all skipped publishes no version.

Log-probs are token-aligned like the batch: ``logp[b, t] = log softmax(z[b, t-1] /
temperature)[tokens[b, t]]`` (0 at t = 0), so they compare one-to-one with
the sampler's behaviour log-probs on the loss-mask tokens.

Router replay (R3): when the batch carries ``routed_experts_B_T_L_K`` and
``router_replay`` is on, every forward (the no-grad one and each micro-batch)
routes each token to exactly the experts the sampler used; the gate
probabilities are still recomputed from the learner's scores, so the router
keeps receiving gradient. With TP > 1 (megatron-core then runs sequence
parallelism) each rank routes only its slice of the sequence: recorded routes
are all-gathered over the tensor-parallel group before they are returned, and
replayed routes are scattered to this rank's slice
(``labrl.harness.models.routing``); sequence lengths must then be multiples of
the TP size, as megatron-core requires.

Reference policy (``reference="initial"``, for ``objective.kl_coef > 0``): a
second, frozen copy of the model takes the policy's weights at the first
``train_step`` — after any warm start, when RL begins — and never trains. The
no-grad pass computes, per micro-batch, ``old`` from the policy and ``ref``
from the frozen copy, both with the sampler's routing replayed when router
replay is on; the objective adds ``kl_coef * k(logp, ref)`` per token. The
frozen weights are part of every checkpoint, so a resumed run keeps the
original reference.

Device and precision (``labrl.harness.models.device``): the model lives on
``config.device`` (``auto``: CUDA when available) in ``config.precision``
(``auto``: bf16 on CUDA from 100M parameters, else fp32). A batch is checked on the host and
copied to the device once per ``train_step``; every tensor the step creates is
created there. Under bf16 the optimizer steps fp32 master weights
(``labrl.harness.learners.precision``); logits are cast to fp32 before the
log-softmax, so log-probs and the loss are fp32 in every precision.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from labrl.errors import ConfigError, LearnerError
from labrl.harness import objectives
from labrl.harness.learners import graph_memory
from labrl.harness.learners.config import LearnerConfig
from labrl.harness.learners.model_parallel import gather_full_state, sequence_parallel
from labrl.harness.learners.precision import adamw_with_precision
from labrl.harness.learners.proximal import proximal_forward
from labrl.harness.models import device as dev
from labrl.harness.models.build import CausalInputs, build_gpt_model, count_parameters, spec_choice
from labrl.harness.models.routing import (
    from_megatron_layout,
    model_router_replays,
    recorded,
    replay_routing,
)
from labrl.harness.rollout.batching import micro_batches, to_device
from labrl.harness.types import TrainBatch

log = logging.getLogger(__name__)

# A micro-batch's share of the prepared batch from (positions, T, its forward's log-probs); None skips the step.
Positions = torch.Tensor | slice
"""A micro-batch's rows: a slice where they are consecutive (views: no gather launch per tensor a
micro-batch reads), else a long tensor of positions."""
Plan = list[tuple[Positions, int]]
"""The micro-batches of one optimizer step: each one's positions and width ``T_mb``."""
MicroPrepared = Callable[[Positions, int, torch.Tensor], objectives.PreparedBatch | None]


def micro_batch_plan(order: list[int], spans: list[tuple[int, int, int]], device: torch.device) -> Plan:
    """``batching.micro_batches``' ``(order, spans)`` as positions on ``device``: slices where the order is
    the batch's own (every span consecutive rows), else one upload of ``order`` and a view of it a span."""
    if order == list(range(len(order))):
        return [(slice(start, stop), T) for start, stop, T in spans]
    order_dev = torch.tensor(order, dtype=torch.long, device=device)
    return [(order_dev[start:stop], T) for start, stop, T in spans]


def _selected(prepared: objectives.PreparedBatch) -> MicroPrepared:
    """Micro-batches of an already prepared batch: their rows of it."""
    return lambda pos, T, logp: prepared.select(pos)


def phase(name: str) -> torch.profiler.record_function:
    """A named range of ``train_step`` (``labrl/<name>``) for ``torch.profiler``: where a step's host time
    goes (``benchmarks/step_profile.py``); next to nothing without a profiler running."""
    return torch.profiler.record_function(f"{PHASE_PREFIX}{name}")


PHASE_PREFIX = "labrl/"
NONFINITE_PROXIMAL = "non-finite proximal log-probs on loss-mask tokens"
NONFINITE_LOSS = "micro-batches with a non-finite loss"


def _tally(checks: dict[str, torch.Tensor], what: str, offending: torch.Tensor) -> None:
    """Add ``offending``'s count to ``checks[what]`` on the device (no host copy)."""
    count = offending.sum()
    checks[what] = checks[what] + count if what in checks else count


def _failures(counts: dict[str, float]) -> str | None:
    """Every check whose count is not 0, as ``"<count> <what>"`` joined by ``"; "`` (the proximal
    log-probs' first: a cause, where a non-finite loss may be its effect), None if none."""
    order = sorted(counts, key=lambda what: what != NONFINITE_PROXIMAL)
    return "; ".join(f"{int(counts[what])} {what}" for what in order if counts[what]) or None


def _read_step(
    checks: dict[str, torch.Tensor], norm_squared: torch.Tensor, summed: objectives.DeviceMetrics
) -> tuple[str | None, float, dict[str, float]]:
    """The step's checks (``_failures``), gradient norm and summed micro-batch metrics, read from the
    device in one host copy: the optimizer step's only wait for the device."""
    head = [c.double().reshape(1) for c in checks.values()] + [norm_squared.double().sqrt().reshape(1)]
    values = torch.cat([*head, summed.vector]).tolist()
    counts = dict(zip(checks, values[: len(checks)], strict=True))
    metrics = dict(zip(summed.names, values[len(checks) + 1 :], strict=True))
    return _failures(counts), values[len(checks)], metrics


class MegatronLearner:
    """Implements ``labrl.harness.types.Learner``; see the module docstring."""

    def __init__(self, config: LearnerConfig | None = None) -> None:
        self.config = config or LearnerConfig()
        cfg = self.config
        caps = dev.detect_capabilities()
        self.device = dev.resolve_device(cfg.device, caps)
        self.dtype = dev.param_dtype(cfg.precision, self.device, parameters=cfg.model.parameter_count)
        self.spec = spec_choice(cfg.model, cfg.parallel, self.device, self.dtype, cfg.experts, caps)
        self.compiled_objective, objective_reason = dev.objective_kernel(
            cfg.objective_kernel, self.device, caps
        )
        # the policy and the reference are built alike: same seed, spec and experts module
        build = functools.partial(
            build_gpt_model,
            cfg.model,
            cfg.parallel,
            seed=cfg.seed,
            routing_replay=True,
            device=self.device,
            dtype=self.dtype,
            experts=cfg.experts,
        )
        self.model = build()
        self.model.train()
        # TP > 1: each rank routes its sequence slice; routes are gathered/scattered for record/replay
        self.sp = sequence_parallel(enabled=bool(getattr(self.model.config, "sequence_parallel", False)))
        self._causal = CausalInputs(self.device)  # position ids and causal masks, made once per length
        model_params = [p for p in self.model.parameters() if p.requires_grad]
        opt = cfg.optimizer
        # fp32 master weights under bf16 (synced from the model at the first train_step)
        self.optimizer, self.master = adamw_with_precision(
            model_params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
        )
        self._masters_synced = False
        self._params = self.master.master_params if self.master is not None else model_params
        # for kept loss-forward graphs (graph_memory): parameters are updated in place, so both hold
        self._parameter_storages = graph_memory.storages(model_params)
        self._gradient_bytes = graph_memory.gradient_bytes(model_params, master=self.master is not None)
        log.info(
            "labrl learner on %s: parameters and compute in %s, %s optimizer (AdamW, %s), %s layer spec, "
            "objective %s",
            self.device,
            dev.precision_reason(cfg.precision, self.device, parameters=cfg.model.parameter_count),
            "fp32 master weights" if self.master is not None else "fp32",
            "fp32 grads",
            self.spec.name,
            objective_reason,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step = 0  # batches trained (train_step calls that took at least one optimizer step)
        self._version = 0
        self.optimizer_steps = 0
        self.consecutive_skips = 0
        # Versions of the last trained batch: proximal = learner at batch start, behaviour = the sampler's.
        self.policy_versions: dict[str, int] = {}
        self.num_parameters = count_parameters(self.model)
        # Built now (init uses a forked RNG, so nothing else shifts); filled at the first train_step.
        self.reference_model = None
        self._reference_frozen = False
        if cfg.reference == "initial":
            self.reference_model = build()
            self.reference_model.train()  # the policy's mode, so equal weights give bit-equal log-probs
            self.reference_model.requires_grad_(False)

    @property
    def reference_frozen(self) -> bool:
        """Whether the reference weights have been taken (at the first train_step or from a checkpoint)."""
        return self._reference_frozen

    def freeze_reference(self) -> None:
        """Copy the policy's current weights into the reference (done by the first ``train_step``)."""
        if self.reference_model is None:
            raise ConfigError("freeze_reference needs LearnerConfig.reference='initial'")
        self.reference_model.load_state_dict(self.model.state_dict())
        self._reference_frozen = True

    # -- Learner protocol ----------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of every parameter and buffer (what a sampler loads), unsharded.

        With tensor or expert parallelism this is a collective: every
        model-parallel rank calls it and gets the TP=1/EP=1 state
        (``labrl.harness.learners.model_parallel.gather_full_state``).
        """
        dev.make_current(self.device)  # the orchestrator calls from a worker thread (see train_step)
        local = {
            k: v.detach().clone()
            for k, v in self.model.state_dict().items()
            if not k.endswith("_extra_state")
        }
        return gather_full_state(local, num_experts=self.config.model.num_experts)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        # the orchestrator calls from a worker thread, and CUDA's current device is per thread (a new
        # one starts on device 0): megatron allocates on the current device, not on the model's
        dev.make_current(self.device)
        cfg = self.config
        started = time.perf_counter()
        with phase("batch_checks"):  # on the host copy, before the one copy to the device
            self._check_batch(batch)
            tokens = int(batch.attention_mask_B_T.sum())
            order, spans = micro_batches(
                batch.attention_mask_B_T, cfg.micro_batch_size, sort_by_length=cfg.length_sorted_micro_batches
            )
        # what the objective computes from the batch alone, on the host copy: no launch, no device wait
        with phase("batch_terms"):
            terms = objectives.batch_terms(
                cfg.objective, objectives.BatchInputs.from_train_batch(batch, self._version)
            )
            behaviour_span = objectives.version_span(batch.versions_B_T, terms.valid_B_T).tolist()
        with phase("upload"):
            batch = to_device(batch, self.device)
            terms = terms.to(self.device)
        plan = micro_batch_plan(order, spans, self.device)
        if self.master is not None and not self._masters_synced:
            self.master.copy_from_model()
            self._masters_synced = True
        replay = batch.routed_experts_B_T_L_K if cfg.router_replay else None
        if self.reference_model is not None and not self._reference_frozen:
            self.freeze_reference()
        proximal = proximal_forward(
            choice=cfg.proximal_forward,
            optimizer_steps=cfg.minibatches * cfg.epochs,
            micro_batches=len(plan),
            whole_batch_terms=objectives.whole_batch_terms(cfg.objective),
            graph_memory_fraction=cfg.graph_memory_fraction,
        )
        proximal_version = self._version
        kept: graph_memory.GraphBudget | None = None
        if proximal.separate:
            prepared, step_metrics, skipped = self._steps_after_proximal_forward(batch, terms, replay, plan)
            no_grad_forwards = len(plan)
        elif proximal.keep_graphs:
            prepared, step_metrics, skipped, kept = self._step_on_kept_graphs(batch, terms, replay, plan)
            no_grad_forwards = len(plan) - kept.kept
        else:
            prepared, step_metrics, skipped = self._step_on_loss_forward(batch, terms, replay, plan)
            no_grad_forwards = 0
        if prepared is None or not step_metrics:
            return self._skip_metrics(started, skipped=skipped)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        self._version += 1
        self.policy_versions = {"proximal": proximal_version, "published": self._version}
        if prepared.num_valid_tokens:  # the oldest and newest behaviour versions (of the host copy)
            lo, hi = behaviour_span
            self.policy_versions |= {"behaviour_min": lo, "behaviour_max": hi}
        elapsed = time.perf_counter() - started
        out = dict(prepared.metrics)
        # Per-step metrics (losses, clip fractions, grad norm) are averaged over the batch's optimizer steps.
        for key in step_metrics[0]:
            out[key] = sum(m[key] for m in step_metrics) / len(step_metrics)
        out |= {
            "learner/lr": lr,
            "learner/step_s": elapsed,
            "learner/tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "learner/tokens": float(tokens),
            "learner/router_replay": float(replay is not None),
            "learner/reference": float(self.reference_model is not None),
            # the share of micro-batches that ran a no-grad forward for their proximal log-probs
            "learner/proximal_forward": no_grad_forwards / len(plan),
            "learner/kept_graphs": float(kept.kept if kept else 0),
            "learner/kept_graph_bytes": float(kept.kept_bytes if kept else 0),  # their saved activations
            "learner/version": float(self._version),
            "learner/proximal_version": float(proximal_version),
            "learner/optimizer_steps": float(len(step_metrics)),
            "learner/skipped_steps": float(skipped),
            "learner/consecutive_skips": float(self.consecutive_skips),
        }
        return out

    def _steps_after_proximal_forward(
        self,
        batch: TrainBatch,
        terms: objectives.BatchTerms,
        replay: torch.Tensor | None,
        plan: Plan,
    ) -> tuple[objectives.PreparedBatch | None, list[dict[str, float]], int]:
        """A no-grad forward over the batch for ``pi_prox`` (and the reference), then every optimizer step.

        Returns the prepared batch (None if the batch was skipped), each
        optimizer step's metrics and the number of skipped steps.
        """
        cfg = self.config
        with_reference = self.reference_model is not None
        with phase("proximal_forward"):
            old_B_T, ref_B_T = self._no_grad_logprobs(
                batch.tokens_B_T, replay, plan, with_reference=with_reference
            )
        prepared = self._prepare_known_proximal(batch, terms, old_B_T, ref_B_T)
        if prepared is None:
            return None, [], 1
        step_metrics: list[dict[str, float]] = []
        skipped = 0
        for rows in self._minibatch_rows(batch.batch_size):
            if rows is None:  # the whole batch: the plan already made for it
                metrics = self._optimizer_step(batch, replay, _selected(prepared), plan)
            else:
                rows = rows.to(self.device)
                order, spans = micro_batches(
                    batch.attention_mask_B_T[rows].cpu(),
                    cfg.micro_batch_size,
                    sort_by_length=cfg.length_sorted_micro_batches,
                )
                sub_plan = micro_batch_plan(order, spans, self.device)
                sub = objectives.minibatch(cfg.objective, prepared, rows)
                metrics = self._optimizer_step(batch, replay, _selected(sub), sub_plan, rows)
            if metrics is None:
                skipped += 1
                continue
            step_metrics.append(metrics)
        return prepared, step_metrics, skipped

    def _step_on_loss_forward(
        self,
        batch: TrainBatch,
        terms: objectives.BatchTerms,
        replay: torch.Tensor | None,
        plan: Plan,
    ) -> tuple[objectives.PreparedBatch | None, list[dict[str, float]], int]:
        """The batch's one optimizer step, each micro-batch's ``pi_prox`` its own loss forward, detached.

        Only for one optimizer step per batch and either one micro-batch or an
        objective without whole-batch terms (``labrl.harness.learners.proximal``).
        The reference log-probs are a no-grad forward of the frozen copy per
        micro-batch. One micro-batch is prepared whole (``objectives.prepare``);
        several take ``objectives.prepare_rows``, and once all have run
        ``objectives.prepare`` over the filled-in ``pi_prox`` gives the batch
        diagnostics (the behaviour mismatch among them), as the separate
        forward would.
        Returns what ``_steps_after_proximal_forward`` does.
        """
        cfg = self.config
        old_B_T = torch.zeros(batch.tokens_B_T.shape, dtype=torch.float32, device=self.device)
        ref_B_T = torch.zeros_like(old_B_T) if self.reference_model is not None else None
        inputs = objectives.ObjectiveInputs.from_train_batch(batch, old_B_T, self._version, ref_B_T)
        # several micro-batches: the proximal log-probs' check counted on the device once the last
        # micro-batch has filled them in, and read after its backward with the step's other checks
        several = len(plan) > 1
        checks: dict[str, torch.Tensor] = {}
        filled = 0  # micro-batches whose pi_prox is in old_B_T

        def from_loss_forward(pos: Positions, T: int, logp: torch.Tensor) -> objectives.PreparedBatch | None:
            nonlocal filled
            old_B_T[pos, :T] = logp.detach()
            filled += 1
            if not several:  # one micro-batch: prepare validates every row, so check before it
                offending = batch.loss_mask_B_T[pos, :T] & objectives.nonfinite(old_B_T[pos, :T])
                if bad := int(offending.sum()):
                    self._record_skip(f"{bad} {NONFINITE_PROXIMAL}: batch skipped")
                    return None
            elif filled == len(plan):  # every row's pi_prox is in (columns past T_mb stay 0: finite)
                _tally(checks, NONFINITE_PROXIMAL, batch.loss_mask_B_T & objectives.nonfinite(old_B_T))
            if ref_B_T is not None:
                routed = None if replay is None else replay[pos, :T]
                with torch.no_grad():
                    ref_B_T[pos, :T] = self._logprobs_with_grad(
                        batch.tokens_B_T[pos, :T], routed, model=self.reference_model
                    )
            if not several:  # every row's pi_prox is known: whole-batch terms (M2PO) included
                whole.append(objectives.prepare(cfg.objective, inputs, terms, values_checked=True))
                return whole[0].select(pos)
            return objectives.prepare_rows(cfg.objective, inputs, pos, terms)

        whole: list[objectives.PreparedBatch] = []
        metrics = self._optimizer_step(
            batch, replay, from_loss_forward, plan, checks=checks, proximal_is_current=True
        )
        if metrics is None:
            return None, [], 1
        if whole:
            return whole[0], [metrics], 0
        with phase("prepare"):  # the batch's diagnostics, once every micro-batch's pi_prox is known
            return objectives.prepare(cfg.objective, inputs, terms, values_checked=True), [metrics], 0

    def _step_on_kept_graphs(
        self,
        batch: TrainBatch,
        terms: objectives.BatchTerms,
        replay: torch.Tensor | None,
        plan: Plan,
    ) -> tuple[objectives.PreparedBatch | None, list[dict[str, float]], int, graph_memory.GraphBudget]:
        """The batch's one optimizer step under a whole-batch term: loss forwards first, backward passes after.

        Each micro-batch's loss forward runs with grad and keeps its graph while
        ``graph_memory.GraphBudget`` admits it (its ``pi_prox`` is that forward,
        detached); one that does not fit gets a no-grad forward now and its loss
        forward in the optimizer step, as under the separate forward. Once every
        row's ``pi_prox`` is known, ``objectives.prepare`` sees the whole batch
        (M2PO's mask among it), and the backward passes run on the kept graphs.
        Returns what ``_steps_after_proximal_forward`` does, and the budget (what it kept).
        """
        cfg = self.config
        old_B_T = torch.zeros(batch.tokens_B_T.shape, dtype=torch.float32, device=self.device)
        ref_B_T = torch.zeros_like(old_B_T) if self.reference_model is not None else None
        self._drop_gradients()  # the budget's free memory is measured without last step's gradients
        budget = graph_memory.GraphBudget(
            free_bytes=graph_memory.free_memory_bytes(self.device),
            fraction=cfg.graph_memory_fraction,
            gradient_bytes=self._gradient_bytes,
        )
        kept: dict[int, torch.Tensor] = {}
        for i, (pos, T) in enumerate(plan):
            tokens = batch.tokens_B_T[pos, :T]
            routed = None if replay is None else replay[pos, :T]
            if i == 0 or graph_memory.agreed(budget.admits(tokens.numel()), self.device):  # the first: always
                with phase("forward"), graph_memory.SavedBytes(self._parameter_storages) as saved:
                    kept[i] = self._logprobs_with_grad(tokens, routed)
                budget.record(tokens.numel(), saved.bytes)
                old_B_T[pos, :T] = kept[i].detach()
            else:
                with phase("proximal_forward"), torch.no_grad():
                    old_B_T[pos, :T] = self._logprobs_with_grad(tokens, routed)
            if ref_B_T is not None:
                with phase("reference"), torch.no_grad():
                    ref_B_T[pos, :T] = self._logprobs_with_grad(tokens, routed, model=self.reference_model)
        prepared = self._prepare_known_proximal(batch, terms, old_B_T, ref_B_T)
        if prepared is None:
            kept.clear()  # the graphs are freed with their outputs
            return None, [], 1, budget
        # pi_prox is the loss forward's own where every micro-batch's graph was kept
        all_kept = len(kept) == len(plan)
        metrics = self._optimizer_step(  # uses up `kept`
            batch, replay, _selected(prepared), plan, kept=kept, proximal_is_current=all_kept
        )
        if metrics is None:
            return None, [], 1, budget
        return prepared, [metrics], 0, budget

    def _prepare_known_proximal(
        self,
        batch: TrainBatch,
        terms: objectives.BatchTerms,
        old_B_T: torch.Tensor,
        ref_B_T: torch.Tensor | None,
    ) -> objectives.PreparedBatch | None:
        """``objectives.prepare`` over the whole batch once every row's ``pi_prox`` is known (the separate
        forward, kept graphs); None, the skip recorded, if any is non-finite on a loss-mask token."""
        with phase("prepare"):
            bad = int((batch.loss_mask_B_T & objectives.nonfinite(old_B_T)).sum())
            if bad:
                self._record_skip(f"{bad} {NONFINITE_PROXIMAL}: batch skipped")
                return None
            inputs = objectives.ObjectiveInputs.from_train_batch(batch, old_B_T, self._version, ref_B_T)
            return objectives.prepare(self.config.objective, inputs, terms, values_checked=True)

    def _minibatch_rows(self, batch_size: int) -> list[torch.Tensor | None]:
        """Row indices of every optimizer step of the batch (None = the whole batch, in order).

        ``epochs`` passes over ``minibatches`` near-equal parts; with several
        parts the rows are shuffled per epoch, seeded by (seed, step, epoch) so a
        resumed run draws the same split.
        """
        cfg = self.config
        if cfg.minibatches == 1:
            return [None] * cfg.epochs
        if batch_size < cfg.minibatches:
            raise ConfigError(
                f"learner.minibatches={cfg.minibatches} needs at least that many sequences per batch "
                f"(got {batch_size}): lower learner.minibatches or raise the batch size"
            )
        out: list[torch.Tensor | None] = []
        for epoch in range(cfg.epochs):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step * 1_009 + epoch)
            perm = torch.randperm(batch_size, generator=gen)
            out.extend(part.sort().values for part in torch.tensor_split(perm, cfg.minibatches))
        return out

    def _optimizer_step(
        self,
        batch: TrainBatch,
        replay: torch.Tensor | None,
        micro_prepared: MicroPrepared,
        plan: Plan,
        rows: torch.Tensor | None = None,
        checks: dict[str, torch.Tensor] | None = None,
        kept: dict[int, torch.Tensor] | None = None,
        proximal_is_current: bool = False,
    ) -> dict[str, float] | None:
        """Forward/backward over ``plan`` (micro-batches of positions) and one AdamW step; None if skipped.

        ``rows`` maps the positions to batch rows (None: the same). ``kept``: log-probs with their graphs
        of loss forwards already run, by index into ``plan`` (``_step_on_kept_graphs``); each is used, and
        dropped, in place of that micro-batch's forward.
        ``micro_prepared(positions, T, logp)`` gives a micro-batch's share of the
        prepared batch from its forward's log-probs ``(b, T)``, or None to skip
        the step (it has recorded why). ``checks``: counts of offending values that
        ``micro_prepared`` tallies on the device (``_tally``); they, the losses'
        finiteness and the micro-batch metrics are read once after the last
        backward, so the loop itself never waits for the device (a wait per
        micro-batch leaves a GPU idle while the host queues the next one). A
        non-finite loss therefore still runs its backward; its gradients are
        dropped with the step. ``proximal_is_current``: every micro-batch's ``pi_prox`` is the forward
        its loss runs on, detached (``objectives.policy_loss``: the ratio is 1, its terms skipped)."""
        checks = {} if checks is None else checks
        kept = {} if kept is None else kept
        self._drop_gradients()
        micro_metrics = []
        losses = []
        T_full = batch.tokens_B_T.shape[1]
        for i, (pos, T) in enumerate(plan):
            if i in kept:
                logp = kept.pop(i)
            else:
                batch_rows = pos if rows is None else rows[pos]
                routed = None if replay is None else replay[batch_rows, :T]
                with phase("forward"):
                    logp = self._logprobs_with_grad(batch.tokens_B_T[batch_rows, :T], routed)
            with phase("objective"):
                prepared = micro_prepared(pos, T, logp)
                if prepared is None:
                    self._drop_gradients()
                    return None
                if T < T_full:  # cut columns are padding: log-prob 0
                    logp = torch.nn.functional.pad(logp, (0, T_full - T))
                loss, metrics = self._policy_loss(logp, prepared, proximal_is_current)
            with phase("backward"):
                loss.backward()
                if self.master is not None:
                    self.master.accumulate_grads()
            micro_metrics.append(metrics)
            losses.append(loss.detach())
        assert prepared is not None  # the last micro-batch's share: its batch metrics are left out
        with phase("checks"):  # counted on the device, then read with the grad norm and the metrics
            _tally(checks, NONFINITE_LOSS, objectives.nonfinite(torch.stack(losses)))
            norm_squared = self._grad_norm_squared()
            summed = objectives.sum_metrics(micro_metrics)
            assert isinstance(summed, objectives.DeviceMetrics)  # policy_loss(device_metrics=True)'s
            failed, grad_norm, step_metrics = _read_step(checks, norm_squared, summed)
        if proximal_is_current:
            step_metrics |= objectives.proximal_is_current_metrics(
                self.config.objective, prepared.num_valid_tokens
            )
        if failed:
            self._drop_gradients()
            self._record_skip(f"{failed} at step {self.step}: optimizer step skipped")
            return None
        if not math.isfinite(grad_norm):
            self._drop_gradients()
            self._record_skip(f"non-finite gradient norm at step {self.step}")
            return None
        with phase("clip"):
            self._clip_gradients(grad_norm)
        with phase("optimizer"):
            self.optimizer.step()
            if self.master is not None:
                self.master.copy_to_model()
        self.optimizer_steps += 1
        self.consecutive_skips = 0
        out = {k: v for k, v in step_metrics.items() if k not in prepared.metrics}
        out["learner/grad_norm"] = grad_norm
        return out

    def _policy_loss(
        self, logp: torch.Tensor, prepared: objectives.PreparedBatch, proximal_is_current: bool
    ) -> tuple[torch.Tensor, Mapping[str, float | torch.Tensor]]:
        """``objectives.policy_loss`` with its metrics on the device, compiled where
        ``learner.objective_kernel`` asks, except under a ``TorchDispatchMode`` (a FLOP counter, a
        tracer), which dynamo compiles nothing under: there the same terms run eager."""
        compiled = self.compiled_objective and not torch._C._len_torch_dispatch_stack()
        return objectives.policy_loss(
            self.config.objective,
            logp,
            prepared,
            device_metrics=True,
            compiled=compiled,
            proximal_is_current=proximal_is_current,
        )

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.zero_grad()

    def _record_skip(self, reason: str) -> None:
        """Count a skipped step; raise once ``max_consecutive_skips`` steps in a row were skipped."""
        self.consecutive_skips += 1
        limit = self.config.max_consecutive_skips
        log.warning("learner step skipped (%d in a row, limit %d): %s", self.consecutive_skips, limit, reason)
        if self.consecutive_skips >= limit:
            raise LearnerError(
                f"{self.consecutive_skips} consecutive learner steps skipped on non-finite values "
                f"(learner.max_consecutive_skips={limit}); last: {reason}"
            )

    def _skip_metrics(self, started: float, skipped: int) -> dict[str, float]:
        """Metrics of a batch that took no optimizer step (weights and version unchanged)."""
        return {
            "learner/step_s": time.perf_counter() - started,
            "learner/version": float(self._version),
            "learner/optimizer_steps": 0.0,
            "learner/skipped_steps": float(skipped),
            "learner/consecutive_skips": float(self.consecutive_skips),
        }

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, LR schedule, step, version and the CPU RNG state, written atomically."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "version": self._version,
            "optimizer_steps": self.optimizer_steps,
            "consecutive_skips": self.consecutive_skips,
            "policy_versions": dict(self.policy_versions),
            "config": self.config.model_dump(mode="json"),
            "rng": torch.get_rng_state(),
        }
        if self.master is not None and self._masters_synced:
            state["master"] = self.master.state_dict()
        if self.reference_model is not None and self._reference_frozen:
            state["reference"] = {
                k: v for k, v in self.reference_model.state_dict().items() if not k.endswith("_extra_state")
            }
        tmp = target.with_name(target.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, target)

    def load_checkpoint(self, path: str) -> None:
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
        except (OSError, RuntimeError) as exc:
            raise LearnerError(f"cannot read checkpoint {path}: {exc}") from exc
        if state.get("config", {}).get("model") != self.config.model.model_dump(mode="json"):
            raise LearnerError(f"checkpoint {path} was written for a different model shape")
        self._check_parameter_layout(path, state["optimizer"])
        result = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise LearnerError(
                f"checkpoint {path}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        self._load_reference(path, state)
        if self.master is not None:
            if "master" in state:
                self.master.load_state_dict(state["master"])
            else:  # written in fp32: the fp32 weights are the master weights
                self.master.copy_from_model()
            self._masters_synced = True
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self._version = int(state["version"])
        # Absent from checkpoints written before mini-batching: one optimizer step per batch then.
        self.optimizer_steps = int(state.get("optimizer_steps", self.step))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.policy_versions = dict(state.get("policy_versions", {}))
        torch.set_rng_state(state["rng"].cpu())

    def _check_parameter_layout(self, path: str, optimizer_state: dict) -> None:
        """The optimizer state (and the fp32 masters) hold one entry per parameter tensor.

        The weights load across experts modules (same state-dict names), but SequentialMLP
        holds two tensors per expert and layer where TorchGroupedMLP holds two per layer.
        """
        saved = sum(len(g["params"]) for g in optimizer_state["param_groups"])
        have = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if saved != have:
            raise LearnerError(
                f"checkpoint {path}: optimizer state for {saved} parameter tensors, this learner has {have} "
                f"({self.spec.experts.name} experts): it was written with the other experts module; resume "
                "with learner.experts=sequential (SequentialMLP) or learner.experts=grouped_mm (TorchGroupedMLP)"
            )

    def _load_reference(self, path: str, state: dict) -> None:
        ref = state.get("reference")
        if self.reference_model is None:
            return  # a checkpoint written with a reference resumes fine without one
        if ref is None:
            if int(state["step"]) > 0:
                raise LearnerError(
                    f"checkpoint {path} (step {state['step']}) holds no reference weights: it was written with "
                    "learner.reference=none, so the weights at the start of RL are lost; resume with "
                    "learner.reference=none and objective.kl_coef=0, or start a new run"
                )
            self._reference_frozen = False  # step 0: the first train_step freezes the loaded weights
            return
        result = self.reference_model.load_state_dict(ref, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise LearnerError(
                f"checkpoint {path} reference: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        self._reference_frozen = True

    # -- log-probs and routing -----------------------------------------------

    def logprobs(self, tokens_B_T: torch.Tensor, routed_B_T_L_K: torch.Tensor | None = None) -> torch.Tensor:
        """Token-aligned log-probs ``(B, T)`` without grad, in micro-batches, on the device of ``tokens_B_T``."""
        routed = None if routed_B_T_L_K is None else routed_B_T_L_K.to(self.device)
        logp, _ = self._no_grad_logprobs(
            tokens_B_T.to(self.device), routed, self._row_plan(tokens_B_T), with_reference=False
        )
        return logp.to(tokens_B_T.device)

    def logprobs_with_reference(
        self, tokens_B_T: torch.Tensor, routed_B_T_L_K: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy and reference log-probs ``(B, T)`` each, in one no-grad pass over the micro-batches.

        Both forwards of a micro-batch replay the same routed experts, so the
        reference is evaluated on the routing the tokens were sampled with.
        Returned on the device of ``tokens_B_T``.
        """
        routed = None if routed_B_T_L_K is None else routed_B_T_L_K.to(self.device)
        old, ref = self._no_grad_logprobs(
            tokens_B_T.to(self.device), routed, self._row_plan(tokens_B_T), with_reference=True
        )
        assert ref is not None
        return old.to(tokens_B_T.device), ref.to(tokens_B_T.device)

    def _row_plan(self, tokens_B_T: torch.Tensor) -> Plan:
        """Micro-batches of consecutive rows at full width (no padding information here)."""
        B, T = tokens_B_T.shape
        size = self.config.micro_batch_size
        return [(slice(s, s + size), T) for s in range(0, B, size)]

    def _no_grad_logprobs(
        self,
        tokens_B_T: torch.Tensor,
        routed_B_T_L_K: torch.Tensor | None,
        plan: Plan,
        *,
        with_reference: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy (and reference) log-probs ``(B, T)`` of device tensors, one micro-batch of ``plan`` at a time.

        Each plan entry is (rows, T_mb): the rows' first ``T_mb`` columns are
        computed, the rest (padding) stays 0.
        """
        if with_reference and (self.reference_model is None or not self._reference_frozen):
            raise ConfigError(
                "logprobs_with_reference needs a frozen reference (LearnerConfig.reference='initial')"
            )
        old = torch.zeros(tokens_B_T.shape, dtype=torch.float32, device=self.device)
        ref = torch.zeros_like(old) if with_reference else None
        with torch.no_grad():
            for rows, T in plan:
                tokens = tokens_B_T[rows, :T]
                routed = None if routed_B_T_L_K is None else routed_B_T_L_K[rows, :T]
                old[rows, :T] = self._logprobs_with_grad(tokens, routed)
                if ref is not None:
                    ref[rows, :T] = self._logprobs_with_grad(tokens, routed, model=self.reference_model)
        return old, ref

    def route(self, tokens_B_T: torch.Tensor) -> torch.Tensor:
        """The experts the learner's own routers pick, ``(B, T, L, K)`` (no replay)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replays = model_router_replays(self.model)
        out = []
        source_device = tokens_B_T.device
        tokens_B_T = tokens_B_T.to(self.device)
        with torch.no_grad():
            for start in range(0, tokens_B_T.shape[0], self.config.micro_batch_size):
                chunk = tokens_B_T[start : start + self.config.micro_batch_size]
                for r in replays:
                    r.clear_indices()
                    r.set_router_replay_action(RouterReplayAction.RECORD)
                try:
                    self._logits(chunk)
                    out.append(from_megatron_layout(recorded(replays, self.sp.group), chunk.shape[0]))
                finally:
                    for r in replays:
                        r.clear_router_replay_action()
                        r.clear_indices()
        return torch.cat(out, dim=0).to(source_device)

    def _logits(self, tokens_B_T: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
        positions, mask = self._causal(*tokens_B_T.shape)
        return (model if model is not None else self.model)(
            input_ids=tokens_B_T, position_ids=positions, attention_mask=mask
        )

    def _logprobs_with_grad(
        self,
        tokens_B_T: torch.Tensor,
        routed_B_T_L_K: torch.Tensor | None,
        model: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        model = model if model is not None else self.model
        if routed_B_T_L_K is None:
            logits = self._logits(tokens_B_T, model)
        else:
            with replay_routing(model, routed_B_T_L_K, sp_rank=self.sp.rank, sp_size=self.sp.size):
                logits = self._logits(tokens_B_T, model)
        scores = logits[:, :-1].float()
        if self.config.temperature != 1.0:  # x / 1.0 == x: skip a pass over (B, T, V), forward and backward
            scores = scores / self.config.temperature
        logp_B_Tm1_V = torch.log_softmax(scores, dim=-1)
        logp = logp_B_Tm1_V.gather(-1, tokens_B_T[:, 1:, None]).squeeze(-1)  # (B, T-1)
        return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)  # (B, T)

    # -- optimisation ----------------------------------------------------------

    def _lr_factor(self, step: int) -> float:
        return self.config.optimizer.lr_factor(step)

    def _grad_norm_squared(self) -> torch.Tensor:
        """Squared global L2 grad norm over the model-parallel ranks, on the device (float64, no host read).

        Tensor-parallel duplicates (norm weights) are counted once; dense
        parameters reduce over the model-parallel group, expert parameters
        (``allreduce=False``) over the expert-model-parallel group. Every rank
        runs the reductions before any reads the result, so a rank that then
        skips the step has not left another waiting in one.
        """
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

        counted = [
            p for p in self._params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)
        ]

        def sum_of_squares(params: list[torch.Tensor]) -> torch.Tensor:
            if not params:
                return torch.zeros((), dtype=torch.float64, device=self.device)
            # one multi-tensor kernel on CUDA instead of a launch per parameter (the same per-tensor
            # norms on CPU, where torch falls back to them)
            norms = torch._foreach_norm([p.grad.detach() for p in params], 2, dtype=torch.float64)
            return torch.stack(norms).square().sum()

        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return sum_of_squares(counted)  # one process: nothing to reduce, one sum for every gradient
        dense = sum_of_squares([p for p in counted if getattr(p, "allreduce", True)])
        expert = sum_of_squares([p for p in counted if not getattr(p, "allreduce", True)])
        torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        torch.distributed.all_reduce(
            expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        )
        return dense + expert

    def _clip_gradients(self, norm: float) -> None:
        """Scale the gradients to ``optimizer.grad_clip`` when the global norm (``_grad_norm_squared``,
        read) exceeds it."""
        clip = self.config.optimizer.grad_clip
        if clip is not None and norm > clip:
            torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], clip / (norm + 1e-6))

    def _check_batch(self, batch: TrainBatch) -> None:
        B, T = batch.tokens_B_T.shape
        if T < 2:
            raise ConfigError(f"TrainBatch has {T} token(s) per row; the learner needs at least 2")
        vocab = self.config.model.vocab_size
        if int(batch.tokens_B_T.max()) >= vocab or int(batch.tokens_B_T.min()) < 0:
            raise ConfigError(f"TrainBatch.tokens_B_T has ids outside the model vocabulary [0, {vocab})")
        routed = batch.routed_experts_B_T_L_K
        if routed is not None:
            want = (B, T, self.config.model.num_moe_layers, self.config.model.moe_router_topk)
            if tuple(routed.shape) != want:
                raise ConfigError(
                    f"TrainBatch.routed_experts_B_T_L_K has shape {tuple(routed.shape)}, expected {want} "
                    "(batch, token, MoE layer, top-k)"
                )
            if int(routed.min()) < 0 or int(routed.max()) >= self.config.model.num_experts:
                raise ConfigError(
                    f"TrainBatch.routed_experts_B_T_L_K holds expert ids outside [0, {self.config.model.num_experts})"
                )
