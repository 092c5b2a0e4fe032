"""Length-sorted micro-batches: less padding, the same step."""

from __future__ import annotations

import torch

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.learners.megatron import micro_batch_plan
from labrl.harness.models import get_preset
from labrl.harness.rollout.batching import micro_batches
from labrl.harness.types import Trajectory

SMALL = get_preset("tiny-moe").model_copy(
    update={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 32}
)


def _mask(lengths: list[int]) -> torch.Tensor:
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return mask


def test_plans_by_hand():
    lengths = [5, 30, 7, 28, 6]
    order, spans = micro_batches(_mask(lengths), 2, sort_by_length=False)
    assert order == [0, 1, 2, 3, 4] and spans == [(0, 2, 30), (2, 4, 30), (4, 5, 30)]
    order, spans = micro_batches(_mask(lengths), 2, sort_by_length=True)
    assert order == [1, 3, 2, 4, 0] and spans == [(0, 2, 30), (2, 4, 7), (4, 5, 5)]
    # padded tokens computed: 5 rows x 30 = 150 -> 2 x 30 + 2 x 7 + 1 x 5 = 79 (76 real)
    assert sum((b - a) * t for a, b, t in spans) == 79


def test_rows_in_batch_order_are_slices_and_sorted_rows_one_upload():
    """Slices make every per-micro-batch read a view (no gather launch); sorted rows are an index."""
    lengths = [5, 30, 7, 28, 6]
    plan = micro_batch_plan(*micro_batches(_mask(lengths), 2, sort_by_length=False), torch.device("cpu"))
    assert plan == [(slice(0, 2), 30), (slice(2, 4), 30), (slice(4, 5), 30)]
    plan = micro_batch_plan(*micro_batches(_mask(lengths), 2, sort_by_length=True), torch.device("cpu"))
    assert [(pos.tolist(), T) for pos, T in plan] == [([1, 3], 30), ([2, 4], 7), ([0], 5)]
    assert plan[0][0].untyped_storage().data_ptr() == plan[2][0].untyped_storage().data_ptr()  # views of one


def _batch(lengths: list[int]):
    from labrl.harness.rollout.batching import collate

    gen = torch.Generator().manual_seed(0)
    trajs = []
    for b, n in enumerate(lengths):
        trajs.append(
            Trajectory(
                env_id="test/fixture-v0", task_id=f"t{b}", group_id=f"g{b // 3}",
                tokens_T=torch.randint(0, 256, (n,), generator=gen).tolist(),
                loss_mask_T=[0] * (n - 4) + [1] * 4, logprobs_T=[-2.0] * n, versions_T=[0] * n,
                reward=float(b % 2), outcome="ok", finish_reason="stop", num_turns=1,
            )
        )  # fmt: skip
    return collate(trajs, pad_token_id=0)


def test_sorted_micro_batches_give_the_padded_step():
    batch = _batch([9, 40, 12, 35, 8, 11])
    steps = {}
    for sort in (False, True):
        learner = MegatronLearner(
            LearnerConfig(model=SMALL, micro_batch_size=2, length_sorted_micro_batches=sort)
        )
        metrics = learner.train_step(batch)
        steps[sort] = (metrics, learner.export_weights())
    (m0, w0), (m1, w1) = steps[False], steps[True]
    assert abs(m0["loss/total"] - m1["loss/total"]) < 1e-6
    assert abs(m0["learner/grad_norm"] - m1["learner/grad_norm"]) < 1e-5 * m0["learner/grad_norm"]
    assert all(torch.allclose(w0[k], w1[k], atol=1e-6) for k in w0)
