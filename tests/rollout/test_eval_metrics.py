"""pass@k of eval rewards against its combinatorial definition (every k-subset of a prompt's samples)."""

import pytest

from slime.rollout.eval_metrics import compute_pass_at_k


def test_pass_at_k_matches_the_combinatorial_definition():
    import itertools

    rewards = [[1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    for k in (1, 2, 3, 5):
        brute = sum(
            sum(any(r[i] > 0 for i in subset) for subset in itertools.combinations(range(5), k))
            / len(list(itertools.combinations(range(5), k)))
            for r in rewards
        ) / len(rewards)
        assert compute_pass_at_k(rewards, k) == pytest.approx(brute)
    assert compute_pass_at_k(rewards, 1) == pytest.approx((0.4 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="pass@6"):
        compute_pass_at_k(rewards, 6)
