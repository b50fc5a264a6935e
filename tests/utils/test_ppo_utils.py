"""ppo_utils against float64 references written from the definitions with plain Python loops, plus invariances."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.utils import ppo_utils as pu

SETTINGS = settings(max_examples=40, deadline=None)


def rand(n, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * scale


# ------------------------------------------------------------------------------------------------------------- KL


def ref_kl(lp, ref, kind, ratio=None):
    out = []
    for i in range(len(lp)):
        d = float(lp[i]) - float(ref[i])
        if kind == "k1":
            v = d
        elif kind == "k2":
            v = d * d / 2
        else:
            v = math.exp(-d) - 1 + d
        if ratio is not None:
            v *= float(ratio[i])
        if kind == "low_var_kl":  # slime clamps the product (after the importance ratio)
            v = min(max(v, -10.0), 10.0)
        out.append(v)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kind", pu.KL_TYPES)
def test_kl_estimators_match_definition(kind):
    lp = torch.cat([rand(50, 2.0, 1), torch.tensor([20.0, -20.0, 0.0], dtype=torch.float64)])
    ref = torch.cat([rand(50, 2.0, 2), torch.zeros(3, dtype=torch.float64)])
    ratio = rand(53, 1.0, 3).exp()
    torch.testing.assert_close(pu.compute_approx_kl(lp, ref, kind), ref_kl(lp, ref, kind))
    torch.testing.assert_close(pu.compute_approx_kl(lp, ref, kind, ratio), ref_kl(lp, ref, kind, ratio))


def test_low_var_kl_is_clamped_and_k3_is_not():
    lp, ref = torch.tensor([-20.0]), torch.tensor([0.0])
    assert pu.compute_approx_kl(lp, ref, "low_var_kl").item() == 10.0
    assert pu.compute_approx_kl(lp, ref, "k3").item() > 1e8


def test_low_var_kl_clamps_after_the_importance_ratio():
    """slime's order (regression: the clamp used to come before the ratio, letting 4 x 10 = 40 through)."""
    lp, ref, ratio = torch.tensor([-20.0, 1.0]), torch.tensor([0.0, 0.0]), torch.tensor([4.0, 0.5])
    kl = pu.compute_approx_kl(lp, ref, "low_var_kl", ratio)
    assert kl[0].item() == 10.0
    assert kl[1].item() == pytest.approx(0.5 * (math.exp(-1.0) - 1 + 1.0))


def test_unknown_kl_type_lists_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        pu.compute_approx_kl(torch.zeros(2), torch.zeros(2), "k4")


# ---------------------------------------------------------------------------------------------------- policy loss


def ref_policy_loss(ppo_kl, adv, eps, eps_high, c=None):
    losses, fracs = [], []
    for k, a in zip(ppo_kl.tolist(), adv.tolist()):
        r = math.exp(-k)
        l1 = -a * r
        l2 = -a * min(max(r, 1 - eps), 1 + eps_high)
        loss = max(l1, l2)
        if c is not None and a < 0:
            loss = min(loss, -c * a)
        losses.append(loss)
        fracs.append(1.0 if l2 > l1 else 0.0)
    return torch.tensor(losses, dtype=torch.float64), torch.tensor(fracs, dtype=torch.float64)


@pytest.mark.parametrize("c", [None, 3.0])
def test_policy_loss_matches_definition(c):
    ppo_kl = torch.cat([rand(200, 0.5, 4), torch.tensor([20.0, -20.0, 0.0, 20.0, -20.0], dtype=torch.float64)])
    adv = torch.cat([rand(200, 1.0, 5), torch.tensor([1.0, 1.0, -1.0, -2.0, -2.0], dtype=torch.float64)])
    loss, frac = pu.compute_policy_loss(ppo_kl, adv, 0.2, 0.28, c)
    ref_loss, ref_frac = ref_policy_loss(ppo_kl, adv, 0.2, 0.28, c)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(frac, ref_frac)
    assert torch.isfinite(loss).all()


def test_policy_loss_on_policy_is_minus_advantage():
    adv = rand(30, 1.0, 6)
    loss, frac = pu.compute_policy_loss(torch.zeros(30, dtype=torch.float64), adv, 0.2, 0.2, 3.0)
    torch.testing.assert_close(loss, -adv)
    assert frac.sum() == 0


def test_dual_clip_bounds_negative_advantage_loss():
    loss, _ = pu.compute_policy_loss(torch.tensor([-20.0]), torch.tensor([-1.0]), 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="eps-clip-c"):
        pu.compute_policy_loss(torch.zeros(1), torch.zeros(1), 0.2, 0.2, 1.0)


# ----------------------------------------------------------------------------------------------- GAE and returns


def ref_gae(r, v, gamma, lam):
    n = len(r)
    adv = [0.0] * n
    last = 0.0
    for t in reversed(range(n)):
        next_v = v[t + 1] if t + 1 < n else 0.0
        delta = r[t] + gamma * next_v - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return torch.tensor(adv, dtype=torch.float64), torch.tensor([a + b for a, b in zip(adv, v)], dtype=torch.float64)


def ref_returns(r, gamma):
    out, g = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        g = r[t] + gamma * g
        out[t] = g
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 300])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 1.0)])
def test_gae_and_returns_match_reverse_loop(n, gamma, lam):
    r, v = rand(n, 1.0, n), rand(n, 1.0, n + 1)
    adv, ret = pu.compute_gae(r, v, gamma, lam)
    ref_adv, ref_ret = ref_gae(r.tolist(), v.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    torch.testing.assert_close(pu.compute_discounted_returns(r, gamma), ref_returns(r.tolist(), gamma))


def test_gae_batched_rows_equal_single_rows():
    r, v = rand(3 * 200, 1.0, 7).view(3, 200), rand(3 * 200, 1.0, 8).view(3, 200)
    adv, ret = pu.compute_gae(r, v, 0.9, 0.8)
    for i in range(3):
        a, b = pu.compute_gae(r[i], v[i], 0.9, 0.8)
        torch.testing.assert_close(adv[i], a)
        torch.testing.assert_close(ret[i], b)


def test_reinforce_plus_plus_token_rewards():
    kl = rand(6, 1.0, 9)
    mask = torch.tensor([1, 1, 0, 1, 0, 0])
    out = pu.reinforce_plus_plus_token_rewards(2.0, kl, mask, 0.1)
    expected = [-0.1 * float(kl[t]) * int(mask[t]) for t in range(6)]
    expected[3] += 2.0  # last masked-in token
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    one = pu.reinforce_plus_plus_token_rewards(1.5, torch.zeros(1), torch.ones(1), 0.1)
    assert one.tolist() == [1.5]


def test_opd_advantage():
    a, old, teacher = rand(5, 1, 10), rand(5, 1, 11), rand(5, 1, 12)
    expected = torch.tensor([a[i] - 0.5 * (old[i] - teacher[i]) for i in range(5)], dtype=torch.float64)
    torch.testing.assert_close(pu.apply_opd_advantage(a, old, teacher, 0.5), expected)


# ------------------------------------------------------------------------------------------- group normalisation


def ref_group_norm(rewards, ids, std_normalize, eps=1e-6):
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if ids[j] == ids[i]]
        n = len(members)
        mean = sum(members) / n
        centred = r - mean
        if std_normalize:
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1)) if n > 1 else 0.0
            centred /= std + eps
        out.append(centred)
    return torch.tensor(out, dtype=torch.float64)


def ref_rloo(rewards, ids):
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if ids[j] == ids[i] and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return torch.tensor(out, dtype=torch.float64)


group_batches = st.lists(
    st.tuples(st.integers(0, 4), st.floats(-5, 5, allow_nan=False).map(lambda x: round(x, 2))), min_size=1, max_size=20
)


@SETTINGS
@given(group_batches, st.booleans())
def test_group_normalisation_matches_reference(batch, std_normalize):
    ids = [g for g, _ in batch]
    rewards = torch.tensor([r for _, r in batch], dtype=torch.float64)
    out = pu.normalize_group_rewards(rewards, ids, std_normalize=std_normalize)
    torch.testing.assert_close(out, ref_group_norm(rewards.tolist(), ids, std_normalize))
    torch.testing.assert_close(pu.compute_rloo_advantages(rewards, ids), ref_rloo(rewards.tolist(), ids))


@SETTINGS
@given(group_batches, st.randoms(use_true_random=False))
def test_group_normalisation_is_permutation_equivariant(batch, rng):
    ids = [g for g, _ in batch]
    rewards = torch.tensor([r for _, r in batch], dtype=torch.float64)
    perm = list(range(len(batch)))
    rng.shuffle(perm)
    out = pu.normalize_group_rewards(rewards, ids)
    permuted = pu.normalize_group_rewards(rewards[perm], [ids[p] for p in perm])
    torch.testing.assert_close(permuted, out[perm])
    relabelled = pu.normalize_group_rewards(rewards, [100 - 7 * g for g in ids])  # id values do not matter
    torch.testing.assert_close(relabelled, out)


def test_group_normalisation_edge_cases():
    out = pu.normalize_group_rewards(torch.tensor([1.0, 1.0, 1.0, 0.3]), [0, 0, 0, 1])
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]  # all-equal group and a singleton group
    # interleaved groups of unequal size, integer rewards
    out = pu.normalize_group_rewards(torch.tensor([1, 0, 0, 5]), torch.tensor([7, 3, 7, 3]), std_normalize=False)
    assert out.tolist() == [0.5, -2.5, -0.5, 2.5]
    strings = pu.normalize_group_rewards(torch.tensor([1.0, 3.0, 2.0]), ["u1", "u2", "u1"], std_normalize=False)
    assert strings.tolist() == [-0.5, 0.0, 0.5]  # any hashable ids (e.g. a rollout uuid)
    with pytest.raises(ValueError, match="same length"):
        pu.normalize_group_rewards(torch.zeros(3), [0, 1])


# ------------------------------------------------------------------------------------------------------ GSPO KL


def test_gspo_kl_is_masked_sequence_mean():
    kl = [rand(5, 1, 13), rand(1, 1, 14), rand(3, 1, 15)]
    masks = [torch.tensor([1, 0, 1, 1, 0]), torch.tensor([1]), torch.tensor([0, 0, 0])]
    out = pu.compute_gspo_kl(kl, masks)
    for x, m, o in zip(kl, masks, out):
        num = sum(float(x[t]) for t in range(len(x)) if m[t])
        den = max(sum(int(v) for v in m), 1)
        torch.testing.assert_close(o, torch.full_like(x, num / den))
    padded = torch.stack([kl[0], torch.cat([kl[2], torch.zeros(2, dtype=torch.float64)])])
    pmask = torch.stack([masks[0], torch.cat([masks[2], torch.zeros(2, dtype=torch.long)])])
    torch.testing.assert_close(pu.compute_gspo_kl(padded, pmask)[0], out[0])


# ---------------------------------------------------------------------------------------------------- value loss


def test_value_loss_matches_definition():
    v, old, ret = rand(100, 1, 16), rand(100, 1, 17), rand(100, 1, 18)
    loss, frac = pu.compute_value_loss(v, old, ret, 0.2)
    for i in range(100):
        clipped = float(old[i]) + min(max(float(v[i] - old[i]), -0.2), 0.2)
        a, b = (clipped - float(ret[i])) ** 2, (float(v[i]) - float(ret[i])) ** 2
        assert loss[i].item() == pytest.approx(max(a, b), rel=1e-12, abs=1e-12)
        assert frac[i].item() == (1.0 if a > b else 0.0)
    assert 0 < frac.sum() < 100


# ------------------------------------------------------------------------------------------------------ whitening


def ref_whiten(values, mask, eps, shift_mean):
    kept = [v for v, m in zip(values, mask) if m]
    n = len(kept)
    mean = sum(kept) / n
    var = sum((k - mean) ** 2 for k in kept) / (n - 1) if n > 1 else 0.0
    out = [(v - mean) / math.sqrt(var + eps) for v in values]
    return torch.tensor(out if shift_mean else [o + mean for o in out], dtype=torch.float64)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_is_bessel_corrected(shift_mean):
    x = rand(40, 3.0, 19) + 2.0
    mask = (rand(40, 1, 20) > 0).long()
    torch.testing.assert_close(
        pu.masked_whiten(x, mask, shift_mean=shift_mean), ref_whiten(x.tolist(), mask.tolist(), 1e-8, shift_mean)
    )


def test_distributed_whiten_equals_single_process():
    x = rand(60, 2.0, 21)
    mask = (rand(60, 1, 22) > -0.5).long()
    shards = [(x[:10], mask[:10]), (x[10:45], mask[10:45]), (x[45:], mask[45:])]
    moments = [pu.masked_moments(xs, ms) for xs, ms in shards]  # what each rank all-reduces
    total = [sum(m[i] for m in moments) for i in range(3)]
    whole = pu.masked_whiten(x, mask)
    for (xs, _), start in zip(shards, [0, 10, 45]):
        torch.testing.assert_close(pu.masked_whiten_from_sums(xs, *total), whole[start : start + len(xs)])


def test_whiten_degenerate_counts():
    x = torch.tensor([3.0, 5.0])
    torch.testing.assert_close(pu.masked_whiten(x, torch.tensor([0, 0])), x)
    torch.testing.assert_close(pu.masked_whiten(x, torch.tensor([1, 0])), torch.tensor([0.0, 2.0 / math.sqrt(1e-8)]))
