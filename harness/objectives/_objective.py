"""The learner-facing API: ``prepare`` once per global batch, ``policy_loss`` per micro-batch.

Learner flow::

    with torch.no_grad():
        old_B_T = logprobs(model, batch)                      # learner at batch start
    prepared = prepare(cfg, ObjectiveInputs.from_train_batch(batch, old_B_T, version))
    for rows in micro_batches:                                # any split of the rows
        loss, m = policy_loss(cfg, logprobs(model, batch[rows]), prepared.select(rows))
        loss.backward()                                       # grads accumulate to the whole-batch gradient
        micro_metrics.append(m)
    metrics = combine_metrics(prepared, micro_metrics)

Everything that depends on the whole batch (advantages, behaviour weights and
masks, M2PO's second moment, the loss denominator, the diagnostics) is computed
in ``prepare``, without grad, so a micro-batch's loss is its exact share of the
whole-batch loss. Per token, the loss minimised is

    l_t = keep_t * weight_t * pg_t(logp, logp_old, A) + kl_coef * k(logp, logp_ref)_t

with ``pg`` the configured policy loss, ``weight`` the product of TIS / IcePop
weights and ``keep`` the AND of the masks, then aggregated over valid tokens
(loss mask and finite sampler log-prob) with the global denominator.

With one optimizer step per batch the no-grad forward can be dropped: each
micro-batch's ``old`` is its loss forward, detached, and ``prepare_rows``
gives its share of ``prepare`` from its own rows when the objective has no
whole-batch term (``whole_batch_terms``: M2PO); ``prepare`` over the filled-in
``old`` then gives the batch metrics.

Decoupled PPO (AReaL, arXiv 2505.24298): three policies are kept apart. The
behaviour policy ``mu`` generated the tokens (sampler log-probs, possibly many
versions old); the proximal policy ``pi_prox`` is the learner at the start of
the batch (``old_logprobs_B_T``, computed once, before the batch's first
optimizer step); ``pi_theta`` is the current parameters. Per token::

    l_t = keep_t * c(pi_prox / mu)_t * pg_t(pi_theta / pi_prox, A)

the trust region (PPO/CISPO/GSPO clip, SAPO gate, dual clip) acts on the
proximal-to-current ratio ``r = pi_theta / pi_prox``, and the configured
behaviour correction ``c`` (TIS, IcePop, masks, M2PO) on the
behaviour-to-proximal ratio ``w = pi_prox / mu``. With one optimizer step per
batch ``r = 1`` at the only step, so the clip never acts; with
``learner.minibatches > 1`` or ``learner.epochs > 1`` the later steps see
``r != 1``. ``minibatch`` re-derives the loss denominator for a subset of rows
so each optimizer step is a full-weight step on its rows, while advantages,
corrections and masks stay those of the whole batch. OPSM is the one
correction evaluated on ``pi_theta`` (at every step, inside ``policy_loss``),
as DeepSeek-V3.2 defines it.

Diagnostics (per step): ``mismatch/abs_log_ratio_mean`` = mean ``|log w|``
(behaviour to proximal, from ``prepare``), ``policy/abs_log_ratio_mean`` =
mean ``|log r|`` (proximal to current), ``policy/clip_low_frac`` /
``clip_high_frac`` / ``dual_clip_frac``, ``corrections/masked_frac`` (tokens
removed by the batch-level masks) and ``opsm/masked_frac``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from labrl.errors import ConfigError, LearnerError

from ._advantages import compute_advantages
from ._aggregation import aggregate, global_denominator, valid_counts
from ._compiled import compiled_loss_terms
from ._config import M2PO, OPSM, TIS, GeoMask, IcePop, ObjectiveConfig, TokenMask, Veto
from ._corrections import (
    geo_mask,
    icepop_weights,
    m2po_mask,
    opsm_mask,
    tis_sequence_weights,
    tis_token_truncated,
    tis_token_weights,
    token_mask,
    veto_mask,
)
from ._diagnostics import behaviour_diagnostics, staleness_stats, version_span
from ._kl import kl_estimate
from ._losses import (
    TokenLoss,
    cispo_loss,
    gspo_loss,
    ppo_loss,
    proximal_is_current_loss,
    reinforce_loss,
    sapo_loss,
)
from ._metrics import DeviceMetrics, Metrics, MetricSums, frac, host_metrics, sum_metrics


@dataclass(frozen=True)
class BatchInputs:
    """What the rollout gives for one global batch (B sequences, T tokens): every input of the objective
    but the learner's log-probs. ``batch_terms`` computes what depends on these alone."""

    loss_mask_B_T: torch.Tensor  # bool: model-generated tokens
    behaviour_logprobs_B_T: torch.Tensor  # sampler log-probs (non-finite ones are dropped)
    versions_B_T: torch.Tensor  # long: policy version per token, -1 off the loss mask
    rewards_B: torch.Tensor  # float
    group_ids_B: torch.Tensor  # long
    learner_version: int

    @classmethod
    def from_train_batch(cls, batch: object, learner_version: int) -> BatchInputs:
        """Build from a ``labrl.harness.types.TrainBatch`` (on whichever device it is)."""
        return cls(
            loss_mask_B_T=batch.loss_mask_B_T,  # type: ignore[attr-defined]
            behaviour_logprobs_B_T=batch.behaviour_logprobs_B_T,  # type: ignore[attr-defined]
            versions_B_T=batch.versions_B_T,  # type: ignore[attr-defined]
            rewards_B=batch.rewards_B,  # type: ignore[attr-defined]
            group_ids_B=batch.group_ids_B,  # type: ignore[attr-defined]
            learner_version=learner_version,
        )

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the field when shapes, dtypes or versions are inconsistent."""
        mask = self.loss_mask_B_T
        if mask.dim() != 2:
            raise ConfigError(f"loss_mask_B_T must be 2-D (B, T), got shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            raise ConfigError(f"loss_mask_B_T must be bool, got {mask.dtype}")
        _check_per_token(
            mask, {"behaviour_logprobs_B_T": self.behaviour_logprobs_B_T, "versions_B_T": self.versions_B_T}
        )
        for name, t in (("rewards_B", self.rewards_B), ("group_ids_B", self.group_ids_B)):
            if tuple(t.shape) != tuple(mask.shape[:1]):
                raise ConfigError(f"{name} has shape {tuple(t.shape)}, expected ({mask.shape[0]},)")
        _check_float({"behaviour_logprobs_B_T": self.behaviour_logprobs_B_T, "rewards_B": self.rewards_B})
        for name, t in (("versions_B_T", self.versions_B_T), ("group_ids_B", self.group_ids_B)):
            if t.is_floating_point() or t.dtype == torch.bool:
                raise ConfigError(f"{name} must be an integer tensor, got {t.dtype}")
        # the value checks in one host read (each read waits for the device)
        nonfinite = (~torch.isfinite(self.rewards_B)).sum()
        nonfinite_rewards, oldest, newest = torch.cat(
            [nonfinite[None], version_span(self.versions_B_T, mask)]
        ).tolist()
        if nonfinite_rewards:
            raise ConfigError(
                "rewards_B has non-finite values: untrainable episodes must be dropped before the objective"
            )
        if oldest < 0:
            raise ConfigError(
                "versions_B_T has a negative version on a loss-mask token: the sampler must tag every generated token"
            )
        if newest > self.learner_version:
            raise ConfigError(
                f"versions_B_T has version {newest} newer than learner_version {self.learner_version}"
            )


def _check_per_token(mask: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(mask.shape):
            raise ConfigError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} like loss_mask_B_T"
            )


def nonfinite(values: torch.Tensor) -> torch.Tensor:
    """Where the float tensor ``values`` is inf or nan, as a bool tensor: ``x - x`` is 0 exactly when ``x``
    is finite. Two kernels where ``~torch.isfinite`` takes five (its ``x == x``, ``abs``, ``!= inf``,
    ``&`` and the ``~``): the learner's checks run every step."""
    return (values - values) != 0


def _check_float(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ConfigError(f"{name} must be a float tensor, got {t.dtype}")


@dataclass(frozen=True)
class ObjectiveInputs:
    """One global batch (B sequences, T tokens), no grad anywhere: the rollout's ``BatchInputs``
    (``batch``) plus the learner's log-probs."""

    loss_mask_B_T: torch.Tensor  # bool: model-generated tokens
    old_logprobs_B_T: torch.Tensor  # learner log-probs at batch start
    behaviour_logprobs_B_T: torch.Tensor  # sampler log-probs (non-finite ones are dropped)
    versions_B_T: torch.Tensor  # long: policy version per token, -1 off the loss mask
    rewards_B: torch.Tensor  # float
    group_ids_B: torch.Tensor  # long
    learner_version: int
    ref_logprobs_B_T: torch.Tensor | None = None

    @classmethod
    def from_train_batch(
        cls,
        batch: object,
        old_logprobs_B_T: torch.Tensor,
        learner_version: int,
        ref_logprobs_B_T: torch.Tensor | None = None,
    ) -> ObjectiveInputs:
        """Build from a ``labrl.harness.types.TrainBatch`` plus the learner's no-grad log-probs."""
        rollout = BatchInputs.from_train_batch(batch, learner_version)
        return cls(
            **{f.name: getattr(rollout, f.name) for f in dataclasses.fields(BatchInputs)},
            old_logprobs_B_T=old_logprobs_B_T,
            ref_logprobs_B_T=ref_logprobs_B_T,
        )

    def to(self, device: torch.device) -> ObjectiveInputs:
        """These inputs with every tensor on ``device``."""
        moved: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if isinstance(value := getattr(self, f.name), torch.Tensor):
                moved[f.name] = value.to(device)
        return dataclasses.replace(self, **moved)

    @property
    def batch(self) -> BatchInputs:
        """The rollout's part of these inputs (the same tensors)."""
        return BatchInputs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BatchInputs)})

    def validate_learner_logprobs(self, *, values: bool = True) -> None:
        """The learner's log-probs: shapes and dtypes, then (``values``) finite on the loss mask, one host read."""
        learner = {"old_logprobs_B_T": self.old_logprobs_B_T}
        if self.ref_logprobs_B_T is not None:
            learner["ref_logprobs_B_T"] = self.ref_logprobs_B_T
        _check_per_token(self.loss_mask_B_T, learner)
        _check_float(learner)
        if values and (bad := int((self.loss_mask_B_T & nonfinite(self.old_logprobs_B_T)).sum())):
            raise LearnerError(
                f"old_logprobs_B_T has {bad} non-finite values on loss-mask tokens: the learner forward is broken"
            )


@dataclass(frozen=True)
class PreparedBatch:
    """What ``policy_loss`` needs, computed once for the global batch; ``select`` rows for micro-batches.

    Tensors are row-indexed (first dim B); ``denominator``, ``num_valid_tokens``,
    ``num_valid_seqs`` and ``metrics`` stay global under ``select``.
    """

    valid_B_T: torch.Tensor  # bool: loss mask and finite sampler log-prob
    keep_B_T: torch.Tensor  # bool: valid and not removed by any correction mask
    weight_B_T: torch.Tensor  # float: product of TIS weights (1 where none applies)
    advantages_B: torch.Tensor  # float
    old_logprobs_B_T: torch.Tensor  # 0 off the valid tokens
    behaviour_logprobs_B_T: torch.Tensor  # 0 off the valid tokens (OPSM reads it per step)
    ref_logprobs_B_T: torch.Tensor | None
    denominator: float
    num_valid_tokens: int
    num_valid_seqs: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.valid_B_T.shape[0])

    def select(self, index: torch.Tensor | slice | list[int]) -> PreparedBatch:
        """The rows ``index`` (slice, list or long/bool tensor) with the global denominator and metrics."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        valid = self.valid_B_T[index]
        return dataclasses.replace(
            self,
            valid_B_T=valid,
            # no correction mask: keep is valid itself (one row gather, not two)
            keep_B_T=valid if self.keep_B_T is self.valid_B_T else self.keep_B_T[index],
            weight_B_T=self.weight_B_T[index],
            advantages_B=self.advantages_B[index],
            old_logprobs_B_T=self.old_logprobs_B_T[index],
            behaviour_logprobs_B_T=self.behaviour_logprobs_B_T[index],
            ref_logprobs_B_T=rows(self.ref_logprobs_B_T),
        )

    def __getitem__(self, index: torch.Tensor | slice | list[int]) -> PreparedBatch:
        return self.select(index)


def minibatch(
    cfg: ObjectiveConfig, prepared: PreparedBatch, index: torch.Tensor | slice | list[int]
) -> PreparedBatch:
    """The rows ``index`` as a batch of their own for one optimizer step.

    Unlike ``select`` (a micro-batch: a share of the global loss), the loss
    denominator and the valid counts are recomputed over these rows, so the
    mini-batch's micro-batch losses sum to the mini-batch's own mean loss.
    Advantages, correction weights, masks and batch metrics stay those computed
    over the whole batch in ``prepare``.
    """
    sub = prepared.select(index)
    n_valid, n_seqs = valid_counts(sub.valid_B_T)
    return dataclasses.replace(
        sub,
        denominator=global_denominator(cfg.aggregation, n_valid, n_seqs, cfg.aggregation_constant),
        num_valid_tokens=n_valid,
        num_valid_seqs=n_seqs,
    )


def _check_learner_inputs(
    cfg: ObjectiveConfig, inputs: ObjectiveInputs, terms: BatchTerms, *, values: bool
) -> None:
    """The learner's log-probs (``validate_learner_logprobs``), the reference the KL term needs, and
    ``terms`` of this batch's shape."""
    inputs.validate_learner_logprobs(values=values)
    if cfg.kl_coef > 0 and inputs.ref_logprobs_B_T is None:
        raise ConfigError("kl_coef > 0 requires ref_logprobs_B_T in ObjectiveInputs (or set kl_coef=0)")
    if tuple(terms.valid_B_T.shape) != tuple(inputs.loss_mask_B_T.shape):
        raise ConfigError(
            f"batch terms of shape {tuple(terms.valid_B_T.shape)} for a batch of {tuple(inputs.loss_mask_B_T.shape)}"
        )


def _assemble(
    cfg: ObjectiveConfig,
    inputs: ObjectiveInputs,
    rows: torch.Tensor | slice,
    valid_rows: torch.Tensor,
    prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    n_valid: int,
    n_seqs: int,
    metrics: dict[str, float] | None = None,
) -> PreparedBatch:
    """The ``PreparedBatch`` of ``rows`` of the batch (every row: ``slice(None)``).

    ``valid_rows`` and ``prepared`` (weight, keep, advantages, old, behaviour) are on those rows; the
    loss denominator and the valid counts are the whole batch's.
    """
    weight, keep, adv, old, mu = prepared
    ref = None
    if inputs.ref_logprobs_B_T is not None:
        ref = torch.where(valid_rows, inputs.ref_logprobs_B_T[rows], 0.0)
    return PreparedBatch(
        valid_B_T=valid_rows,
        keep_B_T=keep,
        weight_B_T=weight.to(old.dtype),
        advantages_B=adv.to(old.dtype),
        old_logprobs_B_T=old,
        behaviour_logprobs_B_T=mu,
        ref_logprobs_B_T=ref,
        denominator=global_denominator(cfg.aggregation, n_valid, n_seqs, cfg.aggregation_constant),
        num_valid_tokens=n_valid,
        num_valid_seqs=n_seqs,
        metrics=metrics if metrics is not None else {},
    )


@dataclass(frozen=True)
class BatchTerms:
    """What ``prepare`` computes without the learner's log-probs, once per batch (``batch_terms``): the valid
    mask and its counts, the advantages, and (``metrics``) their diagnostics, already host floats.

    From the batch alone, so a learner computes them on the host copy of its batch, before the upload:
    on a GPU they then take no kernel launch and no device wait (``to`` moves the two tensors)."""

    valid_B_T: torch.Tensor  # bool: on the loss mask with a finite sampler log-prob
    num_valid_tokens: int
    num_valid_seqs: int
    advantages_B: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)

    def to(self, device: torch.device) -> BatchTerms:
        return dataclasses.replace(
            self, valid_B_T=self.valid_B_T.to(device), advantages_B=self.advantages_B.to(device)
        )


@torch.no_grad()
def batch_terms(cfg: ObjectiveConfig, batch: BatchInputs, *, metrics: bool = True) -> BatchTerms:
    """Validate ``batch`` and compute its ``BatchTerms``; ``metrics=False`` leaves out the diagnostics
    (``tokens/*``, ``seqs/valid``, ``adv/*``, ``staleness/*``) and their host reads."""
    batch.validate()
    valid = batch.loss_mask_B_T & torch.isfinite(batch.behaviour_logprobs_B_T)
    n_valid, n_seqs = valid_counts(valid)
    adv_B, adv_metrics = compute_advantages(
        cfg.advantages, batch.rewards_B, batch.group_ids_B, cfg.advantage_eps, metrics=metrics
    )
    if not metrics:
        return BatchTerms(valid, n_valid, n_seqs, adv_B)
    terms_metrics = {
        "tokens/valid": float(n_valid),
        "tokens/nonfinite_behaviour": float((batch.loss_mask_B_T & ~valid).sum()),
        "seqs/valid": float(n_seqs),
    }
    terms_metrics |= adv_metrics
    terms_metrics |= staleness_stats(batch.versions_B_T, valid, batch.learner_version)
    return BatchTerms(valid, n_valid, n_seqs, adv_B, terms_metrics)


@torch.no_grad()
def prepare(
    cfg: ObjectiveConfig,
    inputs: ObjectiveInputs,
    terms: BatchTerms | None = None,
    *,
    values_checked: bool = False,
) -> PreparedBatch:
    """Advantages, correction weights/masks, global denominator and diagnostics for one global batch.

    ``terms``: the batch's ``batch_terms`` (validated with them), on the inputs' device; without them,
    computed here from ``inputs.batch``. ``values_checked``: the caller has found the proximal
    log-probs finite on the loss mask already (a learner that skips such a batch rather than raise),
    so their shapes are checked here but not their values again (a host read less)."""
    if terms is None:
        terms = batch_terms(cfg, inputs.batch)
    _check_learner_inputs(cfg, inputs, terms, values=not values_checked)
    valid, n_valid, n_seqs = terms.valid_B_T, terms.num_valid_tokens, terms.num_valid_seqs
    adv_B = terms.advantages_B
    metrics: Metrics = dict(terms.metrics)
    old, mu, log_w = _proximal_log_ratio(cfg, inputs.old_logprobs_B_T, inputs.behaviour_logprobs_B_T, valid)
    adv_B_T = adv_B[:, None].expand_as(log_w)

    sums = MetricSums(valid)
    weight, keep = _apply_corrections(cfg, log_w, valid, adv_B_T, n_valid, n_seqs, sums)
    behaviour_diagnostics(sums, log_w, valid, n_valid)
    metrics |= sums.build().to_host()  # the batch's one host read

    return _assemble(
        cfg,
        inputs,
        slice(None),
        valid,
        (weight, keep, adv_B, old, mu),
        n_valid,
        n_seqs,
        host_metrics(metrics),
    )


def whole_batch_terms(cfg: ObjectiveConfig) -> tuple[str, ...]:
    """Names of the corrections that read the proximal log-probs of the whole batch at once.

    M2PO's second-moment mask ranks the active tokens of the whole batch by
    ``l_t^2``, so one row's mask depends on every row's ``pi_prox``. Everything
    else is per token (the losses, TIS token, token mask, IcePop, the KL term)
    or per sequence (TIS sequence, geo mask, veto, OPSM), and advantages and the
    loss denominator do not read ``pi_prox`` at all: without a whole-batch term
    a row's share of ``prepare`` depends on that row's proximal log-probs alone
    (``prepare_rows``).
    """
    return tuple(c.name for c in cfg.corrections if isinstance(c, M2PO))


@torch.no_grad()
def prepare_rows(
    cfg: ObjectiveConfig,
    inputs: ObjectiveInputs,
    rows: torch.Tensor | slice | list[int],
    terms: BatchTerms | None = None,
) -> PreparedBatch:
    """``prepare(cfg, inputs).select(rows)``, reading ``inputs.old_logprobs_B_T`` on ``rows`` only.

    For a learner that takes each micro-batch's proximal log-probs from that
    micro-batch's own forward (one optimizer step per batch: ``pi_prox`` is the
    current forward, detached), before the other rows' are known. Advantages,
    the valid mask, the loss denominator and the valid counts are those of the
    whole batch (none reads ``pi_prox``); weights and masks are computed on the
    rows. ``metrics`` is empty: the batch diagnostics (the behaviour mismatch
    among them) come from ``prepare`` once every row's proximal log-probs are
    known. Raises ``ConfigError`` when the objective has a whole-batch term
    (``whole_batch_terms``). ``terms``: the batch's ``batch_terms``, computed once for all its
    micro-batches; the proximal log-probs' values are then not checked here (the caller checks them
    once every row's are known). Without ``terms``, computed here and every row's log-probs checked
    (the rows not yet known must be finite: zeros will do).
    """
    if whole := whole_batch_terms(cfg):
        raise ConfigError(
            f"corrections {', '.join(whole)} read the whole batch's proximal log-probs: use prepare"
        )
    given = terms is not None
    if terms is None:
        terms = batch_terms(cfg, inputs.batch, metrics=False)
    _check_learner_inputs(cfg, inputs, terms, values=not given)
    if isinstance(rows, list):
        rows = torch.tensor(rows, dtype=torch.long)
    valid, adv_B = terms.valid_B_T, terms.advantages_B
    n_valid, n_seqs = terms.num_valid_tokens, terms.num_valid_seqs
    valid_rows = valid[rows]
    old, mu, log_w = _proximal_log_ratio(
        cfg, inputs.old_logprobs_B_T[rows], inputs.behaviour_logprobs_B_T[rows], valid_rows
    )
    adv_rows = adv_B[rows]
    weight, keep = _apply_corrections(
        cfg, log_w, valid_rows, adv_rows[:, None].expand_as(log_w), n_valid, n_seqs
    )
    return _assemble(cfg, inputs, rows, valid_rows, (weight, keep, adv_rows, old, mu), n_valid, n_seqs)


def _proximal_log_ratio(
    cfg: ObjectiveConfig, old_B_T: torch.Tensor, mu_B_T: torch.Tensor, valid_B_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(old, mu, l)`` zeroed off the valid tokens, ``l = clamp(logp_old - logp_mu, +-log_ratio_clamp)``
    (0 - 0 off them: no third mask)."""
    old = torch.where(valid_B_T, old_B_T, 0.0)
    mu = torch.where(valid_B_T, mu_B_T, 0.0)
    return old, mu, (old - mu).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def _apply_corrections(
    cfg: ObjectiveConfig,
    log_w: torch.Tensor,
    valid: torch.Tensor,
    adv_B_T: torch.Tensor,
    n_valid: int,
    n_seqs: int,
    sums: MetricSums | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrections in the order listed: weights multiply, masks AND; M2PO sees the tokens still kept.

    ``sums`` (over ``valid``) collects the diagnostics; without it (``prepare_rows``, whose caller
    takes them from ``prepare``) the weights and mask only, without the device work of the diagnostics."""
    weight: torch.Tensor | None = None  # 1 everywhere until a weight applies: no product with ones
    keep = valid  # never written in place: each mask makes a new tensor
    for corr in cfg.corrections:
        name = corr.name
        if isinstance(corr, TIS):
            if corr.level == "token":
                w = tis_token_weights(log_w, valid, corr.c)
                if sums is not None:
                    sums.count(f"{name}/truncated_frac", tis_token_truncated(log_w, valid, corr.c), n_valid)
            else:
                w, truncated_B = tis_sequence_weights(log_w, valid, corr.c)
                if sums is not None:
                    sums.value(
                        f"{name}/truncated_seq_frac", truncated_B.sum(dtype=torch.float64) / max(n_seqs, 1)
                    )
                    sums.count(f"{name}/truncated_frac", truncated_B[:, None].expand_as(valid), n_valid)
            weight = w if weight is None else weight * w
            if sums is not None:
                sums.mean(f"{name}/weight_mean", w, n_valid)
            continue
        if isinstance(corr, OPSM):
            continue  # evaluated on the current policy at every step, in policy_loss
        if isinstance(corr, IcePop):
            w, band = icepop_weights(log_w, valid, corr.low, corr.high)
            weight = w if weight is None else weight * w
            if sums is not None:
                sums.value(f"{name}/weight_mean", frac(torch.where(band, w, 0.0).sum(), band.sum()))  # type: ignore[arg-type]
            new_keep = keep & band
        elif isinstance(corr, TokenMask):
            new_keep = keep & token_mask(log_w, valid, corr.low, corr.high)
        elif isinstance(corr, GeoMask | Veto):
            if isinstance(corr, GeoMask):
                seq_keep = geo_mask(log_w, valid, corr.low, corr.high)
            else:
                seq_keep = veto_mask(log_w, valid, corr.floor)
            if sums is not None:
                dropped = (~seq_keep & valid.any(dim=1)).sum(dtype=torch.float64)
                sums.value(f"{name}/masked_seq_frac", dropped / max(n_seqs, 1))
            new_keep = keep & seq_keep[:, None]
        elif isinstance(corr, M2PO):
            res = m2po_mask(log_w, keep, adv_B_T, corr.tau)
            new_keep = res.keep_B_T
            if sums is not None:
                sums.value(f"{name}/second_moment_before", res.second_moment_before)
                sums.value(f"{name}/second_moment_after", res.second_moment_after)
                sums.count(f"{name}/active_frac", res.active_B_T, n_valid)
        else:  # pragma: no cover - the config's discriminated union admits nothing else
            raise ConfigError(f"unknown correction {corr!r}")
        if sums is not None:
            sums.count(f"{name}/masked_frac", keep & ~new_keep, n_valid)
        keep = new_keep
    if weight is None:
        weight = torch.ones_like(log_w)
    if sums is not None:
        sums.count("corrections/kept_frac", keep, n_valid)
        sums.count("corrections/masked_frac", ~keep, n_valid)  # of the valid tokens: the sums' mask
        sums.mean("corrections/weight_mean", torch.where(keep, weight, 0.0), n_valid)
    return weight, keep


def _token_loss(
    cfg: ObjectiveConfig, logp: torch.Tensor, old: torch.Tensor, adv_B: torch.Tensor, valid: torch.Tensor
) -> TokenLoss:
    adv = adv_B[:, None].expand_as(logp)
    clamp = cfg.log_ratio_clamp
    if cfg.loss == "reinforce":
        return reinforce_loss(logp, old, adv, clamp)
    if cfg.loss == "sapo":
        return sapo_loss(logp, old, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg, clamp)
    assert cfg.eps_low is not None and cfg.eps_high is not None  # filled by the config validator
    if cfg.loss == "ppo":
        return ppo_loss(logp, old, adv, cfg.eps_low, cfg.eps_high, clamp, cfg.dual_clip_c)
    if cfg.loss == "cispo":
        return cispo_loss(logp, old, adv, cfg.eps_low, cfg.eps_high, clamp)
    if cfg.loss == "gspo":
        return gspo_loss(logp, old, adv, valid, cfg.eps_low, cfg.eps_high, clamp, cfg.dual_clip_c)
    raise ConfigError(f"loss must be reinforce, ppo, cispo, gspo or sapo (got {cfg.loss!r})")


def policy_loss(
    cfg: ObjectiveConfig,
    logprobs_B_T: torch.Tensor,
    prepared: PreparedBatch,
    *,
    device_metrics: bool = False,
    compiled: bool = False,
    proximal_is_current: bool = False,
) -> tuple[torch.Tensor, Mapping[str, float | torch.Tensor]]:
    """This micro-batch's share of the global loss, and additive metrics (floats; with
    ``device_metrics``, 0-d tensors left on the device for ``combine_metrics`` to read once per step).

    ``logprobs_B_T`` (with grad) must have the micro-batch's shape. The loss is
    already divided by the global denominator: summing it over micro-batches
    gives the whole-batch loss, and calling ``backward`` on each accumulates the
    whole-batch gradient. Every returned metric is likewise additive: its sum over
    the micro-batches is the global value (fractions are over the global count of
    valid tokens). ``combine_metrics`` does the summing.

    ``compiled``: the same terms through ``torch.compile`` (``compiled_loss_terms``): a handful of
    fused kernels, forward and backward, in place of one launch per op.

    ``proximal_is_current``: ``prepared.old_logprobs_B_T`` holds this forward's own log-probs, detached,
    on every valid token (one optimizer step per batch, ``pi_prox`` from the loss forward). Then
    ``r = 1`` exactly: the loss is ``proximal_is_current_loss``, the same value and gradient without
    the ratio and clip, and the ratio and clip metrics are left out, for the caller to add once a
    step (``proximal_is_current_metrics``: constants). Passing it for any other ``old`` is wrong.
    """
    valid = prepared.valid_B_T
    if tuple(logprobs_B_T.shape) != tuple(valid.shape):
        raise ConfigError(
            f"logprobs_B_T has shape {tuple(logprobs_B_T.shape)}, expected {tuple(valid.shape)} (the selected rows)"
        )
    terms = compiled_loss_terms() if compiled else loss_terms
    total, metrics = terms(
        cfg,
        logprobs_B_T,
        valid,
        prepared.keep_B_T,
        prepared.weight_B_T,
        prepared.advantages_B,
        prepared.old_logprobs_B_T,
        prepared.behaviour_logprobs_B_T,
        prepared.ref_logprobs_B_T,
        prepared.denominator,
        prepared.num_valid_tokens,
        prepared.num_valid_seqs,
        proximal_is_current,
    )
    return total, (metrics if device_metrics else host_metrics(metrics))


def loss_terms(
    cfg: ObjectiveConfig,
    logprobs_B_T: torch.Tensor,
    valid: torch.Tensor,
    keep: torch.Tensor,
    weight_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    old_B_T: torch.Tensor,
    behaviour_B_T: torch.Tensor,
    ref_B_T: torch.Tensor | None,
    denominator: float,
    n: int,
    n_seqs: int,
    proximal_is_current: bool = False,
) -> tuple[torch.Tensor, DeviceMetrics]:
    """``policy_loss`` on a micro-batch's tensors: the loss and its ``DeviceMetrics``.

    Tensors and numbers only, the global counts as arguments rather than attributes, so that
    ``torch.compile`` (``dynamic=True``) takes them as symbols: one graph serves every batch
    instead of one per token count."""
    # Padding may hold -inf/nan; `where` keeps it out of values and gradients.
    logp = torch.where(valid, logprobs_B_T, 0.0)
    if proximal_is_current:  # r = 1: no ratio, no clip, their metrics constants (proximal_is_current_metrics)
        tl = None
        loss_B_T = proximal_is_current_loss(
            cfg.loss, logp, advantages_B[:, None].expand_as(logp), cfg.sapo_tau_pos, cfg.sapo_tau_neg
        )
    else:
        tl = _token_loss(cfg, logp, old_B_T, advantages_B, valid)
        loss_B_T = tl.loss_B_T
    sums = MetricSums(valid)
    opsm = next((c for c in cfg.corrections if isinstance(c, OPSM)), None)
    if opsm is not None:
        seq_keep = opsm_mask(logp, behaviour_B_T, advantages_B, valid, opsm.delta)
        dropped = ~seq_keep
        sums.count("opsm/masked_frac", keep & dropped[:, None], n)
        sums.value("opsm/masked_seq_frac", dropped.sum(dtype=torch.float64) / max(n_seqs, 1))
        keep = keep & seq_keep[:, None]
    pg_B_T = torch.where(keep, loss_B_T * weight_B_T, 0.0)  # keep is within valid
    agg = cfg.aggregation
    pg = aggregate(agg, pg_B_T, valid, denominator, masked=True)
    total = pg
    sums.value("loss/policy", pg)
    if cfg.kl_coef > 0:
        assert ref_B_T is not None  # checked in prepare
        k_B_T = kl_estimate(logp, ref_B_T, cfg.kl_estimator, cfg.log_ratio_clamp, cfg.kl_clamp)
        kl_term = cfg.kl_coef * aggregate(agg, k_B_T, valid, denominator)
        total = total + kl_term
        sums.value("loss/ref_kl", kl_term)
        sums.mean(f"ref_kl/{cfg.kl_estimator}", k_B_T, n)
    sums.value("loss/total", total)
    if tl is None:
        return total, sums.build()
    low, high = tl.clipped_low_B_T, tl.clipped_high_B_T
    sums.count("policy/clip_low_frac", low, n)
    sums.count("policy/clip_high_frac", high, n)
    sums.count("policy/clip_frac", low | high, n)
    sums.mean("policy/ratio_mean", tl.ratio_B_T, n)
    sums.mean("policy/abs_log_ratio_mean", (logp.detach() - old_B_T).abs(), n)
    if tl.dual_clipped_B_T is not None:
        sums.count("policy/dual_clip_frac", tl.dual_clipped_B_T, n)
    if tl.gate_B_T is not None:
        sums.mean("policy/sapo_gate_mean", tl.gate_B_T, n)
    return total, sums.build()


def proximal_is_current_metrics(cfg: ObjectiveConfig, num_valid_tokens: int) -> dict[str, float]:
    """The step's ratio and clip metrics where every micro-batch ran ``policy_loss(...,
    proximal_is_current=True)``, which leaves them out: with ``r = 1`` on every token they are
    constants, the values the general path sums to (``ratio_mean`` ``n / n``, the fractions 0)."""
    out = {
        "policy/clip_low_frac": 0.0,
        "policy/clip_high_frac": 0.0,
        "policy/clip_frac": 0.0,
        "policy/ratio_mean": 1.0 if num_valid_tokens else 0.0,
        "policy/abs_log_ratio_mean": 0.0,
    }
    if cfg.dual_clip_c is not None and cfg.loss in ("ppo", "gspo"):
        out["policy/dual_clip_frac"] = 0.0
    if cfg.loss == "sapo":
        out["policy/sapo_gate_mean"] = out["policy/ratio_mean"]  # g_t = 1 on every valid token
    return out


def combine_metrics(
    prepared: PreparedBatch, micro_metrics: Iterable[Mapping[str, float | torch.Tensor]]
) -> dict[str, float]:
    """Global metrics of a step: ``prepared.metrics`` plus the sums of the micro-batch metrics, read in one
    host copy however many micro-batches (``host_metrics``)."""
    return dict(prepared.metrics) | host_metrics(sum_metrics(micro_metrics))
