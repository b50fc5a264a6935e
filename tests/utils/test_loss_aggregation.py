"""Off-policy correction (TIS weights, mismatch metrics) and global-batch loss aggregation (slime.utils.off_policy,
slime.utils.loss_aggregation, re-exported by ppo_utils) against float64 / numpy references and invariances."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.utils import ppo_utils as pu

SETTINGS = settings(max_examples=40, deadline=None)


def rand(n, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * scale


# ------------------------------------------------------------------------------------------------ TIS / mismatch


def test_tis_weight_modes():
    old = [torch.tensor([0.0, math.log(3.0), 0.5]), torch.tensor([0.1, -0.1]), torch.tensor([math.log(5.0)])]
    roll = [torch.zeros(3), torch.zeros(2), torch.zeros(1)]
    masks = [torch.tensor([1, 1, 1]), torch.tensor([1, 1]), torch.tensor([0])]
    raw = [[1.0, 3.0, math.exp(0.5)], [math.exp(0.1), math.exp(-0.1)], [5.0]]
    w, m = pu.compute_tis_weights(old, roll, masks, 0.0, 2.0, "truncate")
    for got, r in zip(w, raw):
        torch.testing.assert_close(got, torch.tensor([min(max(v, 0.0), 2.0) for v in r]))
    n = 5  # masked-in tokens
    flat = [v for r, mk in zip(raw, masks) for v, keep in zip(r, mk.tolist()) if keep]
    assert m["tis"].item() == pytest.approx(sum(flat) / n, rel=1e-6)
    assert m["tis_abs"].item() == pytest.approx(sum(abs(v - 1) for v in flat) / n, rel=1e-6)
    assert m["tis_clipfrac"].item() == pytest.approx(1 / n)

    w, _ = pu.compute_tis_weights(old, roll, masks, 0.5, 2.0, "mask_token")
    for got, r in zip(w, raw):
        torch.testing.assert_close(got, torch.tensor([v if 0.5 <= v <= 2.0 else 0.0 for v in r]))

    w, m = pu.compute_tis_weights(old, roll, masks, 0.5, 2.0, "mask_sequence")
    torch.testing.assert_close(w[0], torch.zeros(3))  # token 1 (ratio 3) rejects the whole sequence
    torch.testing.assert_close(w[1], torch.tensor(raw[1]))
    torch.testing.assert_close(w[2], torch.tensor([5.0]))  # out of range but masked out: sequence kept
    assert m["tis_seq_rejected_frac"].item() == pytest.approx(1 / 3)

    padded_w, _ = pu.compute_tis_weights(
        torch.stack([old[0], torch.zeros(3)]), torch.zeros(2, 3), torch.ones(2, 3), 0.5, 2.0, "mask_sequence"
    )
    assert padded_w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="truncate, mask_token, mask_sequence"):
        pu.compute_tis_weights(old, roll, masks, 0.0, 2.0, "clip")


def test_tis_weights_carry_no_gradient():
    old = torch.zeros(3, requires_grad=True)
    w, _ = pu.compute_tis_weights(old, torch.zeros(3), torch.ones(3), 0.0, 2.0)
    assert not w.requires_grad


def test_mismatch_metrics_match_numpy():
    train, rollout = rand(500, 0.1, 23), rand(500, 0.1, 24)
    mask = (rand(500, 1, 25) > -1).long()
    m = pu.compute_mismatch_metrics(train, rollout, mask, 0.2, 0.28)
    keep = mask.bool().numpy()
    d = (train - rollout).numpy()[keep]
    ratio = np.exp(d)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(np.abs(d).mean())
    for q in (1, 50, 99):
        assert m[f"mismatch_ratio_p{q}"].item() == pytest.approx(np.percentile(ratio, q))
    assert m["mismatch_ratio_outside_clip_frac"].item() == pytest.approx(((ratio < 0.8) | (ratio > 1.28)).mean())
    assert m["mismatch_num_tokens"].item() == keep.sum()
    empty = pu.compute_mismatch_metrics(train, rollout, torch.zeros(500), 0.2, 0.2)
    assert math.isnan(empty["mismatch_ratio_p50"].item()) and empty["mismatch_num_tokens"].item() == 0


# ----------------------------------------------------------------------------------------------- loss aggregation


def ref_aggregate(values, masks, mode, constant):
    num_samples = len(values)
    total_tokens = sum(sum(m) for m in masks)
    acc = 0.0
    for x, m in zip(values, masks):
        s = sum(a * b for a, b in zip(x, m))
        acc += s / max(sum(m), 1) if mode == "sample_mean" else s
    denom = {"sample_mean": num_samples, "token_mean": total_tokens, "constant": num_samples * constant}[mode]
    return acc / denom


sample_batches = st.lists(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(-3, 3, allow_nan=False), min_size=n, max_size=n),
            st.lists(st.integers(0, 1), min_size=n, max_size=n),
        )
    ),
    min_size=1,
    max_size=8,
).filter(lambda b: sum(sum(m) for _, m in b) > 0)


@SETTINGS
@given(sample_batches, st.sampled_from(pu.LOSS_AGGREGATION_MODES), st.randoms(use_true_random=False), st.booleans())
def test_aggregate_loss_is_micro_batch_invariant(batch, mode, rng, packed):
    constant = 8.0
    masks = [torch.tensor(m) for _, m in batch]
    denom = pu.loss_denominator(mode, masks, constant)

    full_inputs = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x, _ in batch]
    full = pu.aggregate_loss(full_inputs, masks, mode, denom)
    assert full.item() == pytest.approx(ref_aggregate([x for x, _ in batch], [m for _, m in batch], mode, constant))
    full.backward()

    # a random split into micro-batches (ranks are the same thing: disjoint subsets summed)
    split_inputs = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x, _ in batch]
    order = list(range(len(batch)))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), rng.randint(0, len(order) - 1))) if len(order) > 1 else []
    parts = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    denoms = sum(pu.loss_denominator(mode, [masks[i] for i in part], constant) for part in parts)
    assert denoms == denom
    total = 0.0
    for part in parts:
        vals = [split_inputs[i] for i in part]
        if packed:
            vals = torch.cat(vals)
        micro = pu.aggregate_loss(vals, [masks[i] for i in part], mode, denom)
        micro.backward()
        total += micro.item()
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    for a, b in zip(full_inputs, split_inputs):
        torch.testing.assert_close(a.grad, b.grad)


def test_aggregate_loss_rollout_denominators_and_errors():
    values = [torch.tensor([1.0, 2.0]), torch.tensor([4.0])]
    masks = [torch.tensor([1, 1]), torch.tensor([1])]
    # two samples of one rollout with 3 tokens in total: per-rollout token mean
    out = pu.aggregate_loss(values, masks, "sample_mean", 1.0, sample_token_counts=[3, 3])
    assert out.item() == pytest.approx(7.0 / 3)
    with pytest.raises(ValueError, match="sample_mean, token_mean, constant"):
        pu.aggregate_loss(values, masks, "seq_mean", 1.0)
    with pytest.raises(ValueError, match="global_denominator"):
        pu.aggregate_loss(values, masks, "token_mean", 0)
    with pytest.raises(ValueError, match="packed values"):
        pu.aggregate_loss(torch.zeros(4), masks, "token_mean", 1.0)
    with pytest.raises(ValueError, match="positive constant"):
        pu.loss_denominator("constant", masks)
    assert pu.loss_denominator("token_mean", masks) == 3.0
