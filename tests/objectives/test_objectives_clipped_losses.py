"""Dual-clip PPO, SAPO, IcePop, OPSM, k3_clamped and the decoupled-PPO composition.

Every value and gradient is checked against an independent reference: a plain
Python loop over tokens (``math`` only, float64) for the value, and a central
finite difference of that loop for the gradient. The torch code under test is
never used to compute an expected number.
"""

from __future__ import annotations

import math

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.objectives import (
    OPSM,
    TIS,
    IcePop,
    ObjectiveConfig,
    TokenMask,
    combine_metrics,
    kl_estimate,
    minibatch,
    policy_loss,
    ppo_loss,
    prepare,
    sapo_loss,
)

H = 1e-6  # finite-difference step


def _fd_grad(f, xs: list[float]) -> list[float]:
    """Central finite difference of the scalar f at xs, one coordinate at a time."""
    out = []
    for i in range(len(xs)):
        up = list(xs)
        dn = list(xs)
        up[i] += H
        dn[i] -= H
        out.append((f(up) - f(dn)) / (2 * H))
    return out


def _autograd(fn, logp: list[float]) -> tuple[list[float], list[float]]:
    """Per-token loss values and the gradient of their sum, from the torch function under test."""
    x = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    tl = fn(x)
    tl.loss_B_T.sum().backward()
    return tl.loss_B_T[0].tolist(), x.grad[0].tolist()


# -- dual-clip PPO -------------------------------------------------------------


def _ppo_dual_ref(logp: float, old: float, a: float, lo: float, hi: float, c: float | None) -> float:
    r = math.exp(logp - old)
    loss = -min(r * a, min(max(r, lo), hi) * a)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss


# ratios r = 0.5, 0.9, 1.5, 2.5, 4.0, 6.0 against advantages of both signs
OLD = [-1.0, -2.0, -0.5, -1.5, -3.0, -0.7]
LOG_R = [math.log(x) for x in (0.5, 0.9, 1.5, 2.5, 4.0, 6.0)]
ADV = [-1.0, 0.7, -0.4, -1.3, 0.9, -2.0]


def test_dual_clip_ppo_values_and_gradients_match_a_python_loop() -> None:
    c = 3.0
    logp = [o + lr for o, lr in zip(OLD, LOG_R, strict=True)]
    old_t = torch.tensor([OLD], dtype=torch.float64)
    adv_t = torch.tensor([ADV], dtype=torch.float64)
    values, grad = _autograd(lambda x: ppo_loss(x, old_t, adv_t, 0.2, 0.28, dual_clip_c=c), logp)
    want = [_ppo_dual_ref(lp, o, a, 0.8, 1.28, c) for lp, o, a in zip(logp, OLD, ADV, strict=True)]
    assert values == pytest.approx(want, abs=1e-12)

    def total(xs: list[float]) -> float:
        return sum(_ppo_dual_ref(x, o, a, 0.8, 1.28, c) for x, o, a in zip(xs, OLD, ADV, strict=True))

    assert grad == pytest.approx(_fd_grad(total, logp), abs=1e-6)
    # Token 5 (r = 6 > c, A < 0) is dual-clipped: value c|A| and no gradient; token 3 (r = 2.5 < c) is not.
    assert values[5] == pytest.approx(3.0 * 2.0)
    assert grad[5] == 0.0
    assert grad[3] != 0.0
    tl = ppo_loss(torch.tensor([logp], dtype=torch.float64), old_t, adv_t, 0.2, 0.28, dual_clip_c=c)
    assert tl.dual_clipped_B_T[0].tolist() == [False, False, False, False, False, True]


def test_dual_clip_off_is_plain_ppo() -> None:
    logp = torch.tensor([[o + lr for o, lr in zip(OLD, LOG_R, strict=True)]], dtype=torch.float64)
    old_t, adv_t = torch.tensor([OLD], dtype=torch.float64), torch.tensor([ADV], dtype=torch.float64)
    plain = ppo_loss(logp, old_t, adv_t)
    assert plain.dual_clipped_B_T is None
    want = [_ppo_dual_ref(float(x), o, a, 0.8, 1.28, None) for x, o, a in zip(logp[0], OLD, ADV, strict=True)]
    assert plain.loss_B_T[0].tolist() == pytest.approx(want, abs=1e-12)
    assert want[5] == pytest.approx(6.0 * 2.0)  # without the dual clip the exploded ratio pushes r|A|


# -- SAPO ------------------------------------------------------------------------


def _sapo_ref(logp: float, old: float, a: float, tau_pos: float, tau_neg: float) -> float:
    r = math.exp(logp - old)
    tau = tau_pos if a > 0 else tau_neg
    return -(4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))) * a


@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_values_and_gradients_match_a_python_loop(tau_pos: float, tau_neg: float) -> None:
    logp = [o + lr for o, lr in zip(OLD, LOG_R, strict=True)]
    old_t = torch.tensor([OLD], dtype=torch.float64)
    adv_t = torch.tensor([ADV], dtype=torch.float64)
    values, grad = _autograd(lambda x: sapo_loss(x, old_t, adv_t, tau_pos, tau_neg), logp)
    assert values == pytest.approx(
        [_sapo_ref(lp, o, a, tau_pos, tau_neg) for lp, o, a in zip(logp, OLD, ADV, strict=True)], abs=1e-12
    )

    def total(xs: list[float]) -> float:
        return sum(_sapo_ref(x, o, a, tau_pos, tau_neg) for x, o, a in zip(xs, OLD, ADV, strict=True))

    assert grad == pytest.approx(_fd_grad(total, logp), abs=1e-6)


def test_sapo_gate_is_one_on_policy_and_decays_off_policy() -> None:
    # On-policy the SAPO gradient equals REINFORCE's -A grad logp (gate 1); far off-policy it vanishes.
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    logp = torch.tensor([[0.0, 0.0, math.log(20.0)]], dtype=torch.float64, requires_grad=True)
    tl = sapo_loss(logp, old, adv)
    tl.loss_B_T.sum().backward()
    assert logp.grad[0, :2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-12)
    assert tl.gate_B_T[0, :2].tolist() == pytest.approx([1.0, 1.0], abs=1e-12)
    assert 0 < tl.gate_B_T[0, 2] < 1e-5
    assert not tl.clipped_low_B_T.any() and not tl.clipped_high_B_T.any()


# -- k3_clamped (verl low_var_kl) --------------------------------------------------


def test_k3_clamped_values_and_gradients() -> None:
    logp = [-1.0, -1.0, -1.0, -1.0]
    ref = [-1.0, -0.5, -3.0, 2.0]  # the last one: l = 3, k3 = e^3 - 4 = 16.1 > 10

    def ref_k3(x: float, r: float) -> float:
        lr = r - x
        return max(-10.0, min(10.0, math.exp(lr) - 1.0 - lr))

    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    k = kl_estimate(x, torch.tensor(ref, dtype=torch.float64), "k3_clamped")
    k.sum().backward()
    assert k.tolist() == pytest.approx([ref_k3(a, b) for a, b in zip(logp, ref, strict=True)], abs=1e-12)
    assert k[3].item() == 10.0
    assert x.grad.tolist() == pytest.approx(
        _fd_grad(lambda xs: sum(ref_k3(a, b) for a, b in zip(xs, ref, strict=True)), logp), abs=1e-6
    )
    assert x.grad[3].item() == 0.0  # clamped: no gradient
    # Below the clamp it equals k3.
    k3 = kl_estimate(x.detach(), torch.tensor(ref, dtype=torch.float64), "k3")
    assert k[:3].tolist() == pytest.approx(k3[:3].tolist(), abs=0)


def test_k3_clamped_as_reference_kl_in_the_objective(make_batch) -> None:
    b = make_batch(dtype=torch.float64)
    ref = b.inputs.old_logprobs_B_T.clone()
    ref[0, 0] += 5.0  # one token far from the reference: k3 = e^5 - 6 = 142 -> 10
    inputs = type(b.inputs)(**{**b.inputs.__dict__, "ref_logprobs_B_T": ref})
    cfg = ObjectiveConfig(loss="reinforce", corrections=[], kl_coef=0.5, kl_estimator="k3_clamped")
    p = prepare(cfg, inputs)
    logp = b.logprobs(b.logits_B_T_V)
    _, m = policy_loss(cfg, logp, p)
    valid = p.valid_B_T
    total = 0.0
    for i in range(valid.shape[0]):
        for t in range(valid.shape[1]):
            if valid[i, t]:
                lr = float(ref[i, t] - logp[i, t])
                total += min(10.0, math.exp(lr) - 1 - lr)
    assert m["ref_kl/k3_clamped"] == pytest.approx(total / int(valid.sum()), rel=1e-12)
    assert m["loss/ref_kl"] == pytest.approx(0.5 * total / int(valid.sum()), rel=1e-12)


# -- IcePop and the batch-level corrections --------------------------------------------


def _loop_objective(p, logp_B_T, token_fn, weight_fn) -> float:
    """sum over valid tokens of keep * weight * token_loss, over the valid-token count (token_mean)."""
    valid = p.valid_B_T
    total = 0.0
    for i in range(valid.shape[0]):
        a = float(p.advantages_B[i])
        for t in range(valid.shape[1]):
            if not valid[i, t]:
                continue
            w = math.exp(float(p.old_logprobs_B_T[i, t] - p.behaviour_logprobs_B_T[i, t]))
            total += weight_fn(w) * token_fn(float(logp_B_T[i, t]), float(p.old_logprobs_B_T[i, t]), a)
    return total / int(valid.sum())


def _icepop_weight(w: float, low: float = 0.5, high: float = 5.0) -> float:
    return w if low <= w <= high else 0.0


def test_icepop_weights_kept_tokens_by_the_ratio_and_masks_the_rest(make_batch) -> None:
    b = make_batch(dtype=torch.float64, log_w_scale=1.0)  # wide ratios: some outside [0.5, 5]
    cfg = ObjectiveConfig(loss="reinforce", corrections=[IcePop()])
    p = prepare(cfg, b.inputs)
    logp0 = b.logprobs(b.logits_B_T_V).detach()
    x = logp0.clone().requires_grad_(True)
    loss, m = policy_loss(cfg, x, p)
    loss.backward()

    def reinforce(lp: float, _old: float, a: float) -> float:
        return -a * lp

    assert float(loss.detach()) == pytest.approx(
        _loop_objective(p, logp0, reinforce, _icepop_weight), rel=1e-12
    )
    # Gradient of a REINFORCE token is -A * weight / N: compare every valid token.
    n = int(p.valid_B_T.sum())
    for i, t in p.valid_B_T.nonzero().tolist():
        w = math.exp(float(p.old_logprobs_B_T[i, t] - p.behaviour_logprobs_B_T[i, t]))
        want = -float(p.advantages_B[i]) * _icepop_weight(w) / n
        assert float(x.grad[i, t]) == pytest.approx(want, abs=1e-12)
    masked = [
        (i, t)
        for i, t in p.valid_B_T.nonzero().tolist()
        if _icepop_weight(math.exp(float(p.old_logprobs_B_T[i, t] - p.behaviour_logprobs_B_T[i, t]))) == 0
    ]
    assert masked, "the fixture must put some ratios outside the band"
    m = combine_metrics(p, [m])
    assert m["icepop/masked_frac"] == pytest.approx(len(masked) / n)
    assert m["corrections/masked_frac"] == pytest.approx(len(masked) / n)


def test_token_mask_keeps_weight_one_unlike_icepop(make_batch) -> None:
    b = make_batch(dtype=torch.float64, log_w_scale=1.0)
    logp = b.logprobs(b.logits_B_T_V).detach()
    masked_cfg = ObjectiveConfig(loss="reinforce", corrections=[TokenMask()])
    icepop_cfg = ObjectiveConfig(loss="reinforce", corrections=[IcePop()])
    pm, pi = prepare(masked_cfg, b.inputs), prepare(icepop_cfg, b.inputs)
    assert torch.equal(pm.keep_B_T, pi.keep_B_T)  # same band, same mask
    lm, _ = policy_loss(masked_cfg, logp, pm)

    def reinforce(lp: float, _old: float, a: float) -> float:
        return -a * lp

    assert float(lm) == pytest.approx(
        _loop_objective(pm, logp, reinforce, lambda w: 1.0 if 0.5 <= w <= 5.0 else 0.0), rel=1e-12
    )


def test_decoupled_ppo_is_behaviour_weight_times_proximal_clip(make_batch) -> None:
    """AReaL's decoupled loss: l_t = (pi_prox / mu) * -min(r A, clip(r) A), r = pi_theta / pi_prox."""
    b = make_batch(dtype=torch.float64, log_w_scale=0.3)
    cfg = ObjectiveConfig(loss="ppo", corrections=[TIS(c=1e6)])  # an untruncated behaviour weight
    p = prepare(cfg, b.inputs)
    g = torch.Generator().manual_seed(3)
    theta = b.logits_B_T_V + 0.4 * torch.randn(b.logits_B_T_V.shape, generator=g, dtype=torch.float64)
    logp0 = b.logprobs(theta).detach()  # a current policy several steps past the proximal one
    x = logp0.clone().requires_grad_(True)
    loss, m = policy_loss(cfg, x, p)
    loss.backward()

    def ppo(lp: float, old: float, a: float) -> float:
        return _ppo_dual_ref(lp, old, a, 0.8, 1.28, None)

    assert float(loss.detach()) == pytest.approx(_loop_objective(p, logp0, ppo, lambda w: w), rel=1e-10)
    flat = [(i, t) for i, t in p.valid_B_T.nonzero().tolist()]

    def f(xs: list[float]) -> float:
        lp = logp0.clone()
        for (i, t), v in zip(flat, xs, strict=True):
            lp[i, t] = v
        return _loop_objective(p, lp, ppo, lambda w: w)

    fd = _fd_grad(f, [float(logp0[i, t]) for i, t in flat])
    assert [float(x.grad[i, t]) for i, t in flat] == pytest.approx(fd, abs=1e-6)
    assert m["policy/clip_low_frac"] + m["policy/clip_high_frac"] > 0  # the proximal clip acts
    want_abs = sum(abs(float(logp0[i, t] - p.old_logprobs_B_T[i, t])) for i, t in flat) / len(flat)
    assert m["policy/abs_log_ratio_mean"] == pytest.approx(want_abs, rel=1e-12)
    want_mu = sum(
        abs(float(p.old_logprobs_B_T[i, t] - p.behaviour_logprobs_B_T[i, t])) for i, t in flat
    ) / len(flat)
    assert p.metrics["mismatch/abs_log_ratio_mean"] == pytest.approx(want_mu, rel=1e-12)


# -- OPSM ------------------------------------------------------------------------------


def _opsm_loop(p, logp, delta: float) -> tuple[float, int]:
    """REINFORCE with OPSM on the current log-probs, and the number of masked sequences."""
    valid = p.valid_B_T
    total, dropped = 0.0, 0
    for i in range(valid.shape[0]):
        ts = [t for t in range(valid.shape[1]) if valid[i, t]]
        a = float(p.advantages_B[i])
        kl = sum(float(p.behaviour_logprobs_B_T[i, t] - logp[i, t]) for t in ts) / len(ts)
        if a < 0 and kl > delta:
            dropped += 1
            continue
        total += sum(-a * float(logp[i, t]) for t in ts)
    return total / int(valid.sum()), dropped


def test_opsm_masks_negative_sequences_far_from_the_behaviour_policy(make_batch) -> None:
    b = make_batch(dtype=torch.float64, log_w_scale=0.5)
    delta = 0.05
    cfg = ObjectiveConfig(loss="reinforce", corrections=[OPSM(delta=delta)])
    p = prepare(cfg, b.inputs)
    logp0 = b.logprobs(b.logits_B_T_V).detach()
    x = logp0.clone().requires_grad_(True)
    loss, m = policy_loss(cfg, x, p)
    loss.backward()
    want, dropped = _opsm_loop(p, logp0, delta)
    assert dropped > 0, "delta must drop some negative-advantage sequence of the fixture"
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    assert m["opsm/masked_seq_frac"] == pytest.approx(dropped / p.num_valid_seqs)
    flat = p.valid_B_T.nonzero().tolist()

    def f(xs: list[float]) -> float:
        lp = logp0.clone()
        for (i, t), v in zip(flat, xs, strict=True):
            lp[i, t] = v
        # the mask is a stop-gradient decision: hold it at logp0's
        keep_rows = {
            i
            for i in range(lp.shape[0])
            if not (
                float(p.advantages_B[i]) < 0
                and sum(
                    float(p.behaviour_logprobs_B_T[i, t] - logp0[i, t])
                    for t in range(lp.shape[1])
                    if p.valid_B_T[i, t]
                )
                / int(p.valid_B_T[i].sum())
                > delta
            )
        }
        return sum(-float(p.advantages_B[i]) * float(lp[i, t]) for i, t in flat if i in keep_rows) / len(flat)

    fd = _fd_grad(f, [float(logp0[i, t]) for i, t in flat])
    assert [float(x.grad[i, t]) for i, t in flat] == pytest.approx(fd, abs=1e-6)


def test_opsm_reads_the_current_policy_not_the_proximal_one(make_batch) -> None:
    b = make_batch(dtype=torch.float64, log_w_scale=0.0)  # behaviour == proximal
    cfg = ObjectiveConfig(loss="reinforce", corrections=[OPSM(delta=0.01)])
    p = prepare(cfg, b.inputs)
    at_start = b.logprobs(b.logits_B_T_V)
    _, m0 = policy_loss(cfg, at_start, p)
    assert m0["opsm/masked_seq_frac"] == 0.0  # on-policy: KL 0
    moved = at_start - 0.5  # the current policy now gives every sampled token less mass
    _, m1 = policy_loss(cfg, moved, p)
    n_neg = int(((p.advantages_B < 0) & p.valid_B_T.any(1)).sum())
    assert m1["opsm/masked_seq_frac"] == pytest.approx(n_neg / p.num_valid_seqs)


# -- mini-batches -------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
def test_minibatch_is_a_full_weight_batch_of_its_rows(make_batch, agg: str) -> None:
    b = make_batch(dtype=torch.float64)
    const = {"aggregation_constant": 8.0} if agg == "seq_sum_constant" else {}
    cfg = ObjectiveConfig(loss="ppo", corrections=[TIS()], aggregation=agg, **const)
    p = prepare(cfg, b.inputs)
    logp = b.logprobs(b.logits_B_T_V)
    rows = torch.tensor([0, 2, 5])
    mb = minibatch(cfg, p, rows)
    loss, _ = policy_loss(cfg, logp[rows], mb)
    valid = p.valid_B_T[rows]
    per_tok = -p.advantages_B[rows][:, None] * p.weight_B_T[rows]  # r = 1: ppo = -A * w per token
    if agg == "token_mean":
        want = float((per_tok * valid).sum() / valid.sum())
    elif agg == "seq_mean_token_mean":
        want = float(((per_tok * valid).sum(1) / valid.sum(1)).sum() / valid.any(1).sum())
    else:
        want = float((per_tok * valid).sum() / (8.0 * valid.any(1).sum()))
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    assert mb.num_valid_tokens == int(valid.sum())
    # Micro-batches of a mini-batch still add up to it.
    parts = [policy_loss(cfg, logp[rows][s], mb.select(s)) for s in (slice(0, 1), slice(1, 3))]
    assert sum(float(x) for x, _ in parts) == pytest.approx(float(loss.detach()), rel=1e-12)
    assert combine_metrics(mb, [x for _, x in parts])["policy/ratio_mean"] == pytest.approx(1.0)


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"loss": "cispo", "dual_clip_c": 3.0}, "dual_clip_c only applies to loss=ppo or gspo"),
        ({"loss": "ppo", "dual_clip_c": 1.2}, "must exceed 1 \\+ eps_high"),
        ({"loss": "sapo", "eps_high": 0.2}, "no effect with loss=sapo"),
        ({"corrections": [{"kind": "icepop", "low": 1.5}]}, "icepop needs low <= 1 <= high"),
        ({"corrections": [{"kind": "opsm", "delta": -1}]}, "corrections.0.opsm.delta"),
        ({"kl_estimator": "low_var"}, "kl_estimator"),
    ],
)
def test_new_options_reject_bad_values(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ObjectiveConfig.from_dict(data)


def test_new_options_default_off() -> None:
    cfg = ObjectiveConfig()
    assert cfg.dual_clip_c is None and cfg.kl_estimator == "k3"
    assert cfg.corrections == [TIS()]
    sapo = ObjectiveConfig.from_dict({"loss": "sapo", "corrections": ["icepop", "opsm"]})
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)
    assert sapo.corrections == [IcePop(low=0.5, high=5.0), OPSM(delta=1e-4)]
    assert sapo.clip_range == (0.0, math.inf)
