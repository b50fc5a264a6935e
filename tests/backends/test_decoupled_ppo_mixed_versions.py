"""The off-policy correction of fully async training on a batch whose tokens come from three policy versions (a
sample cut by a weight push has two): decoupled PPO as `--use-tis` computes it (proximal policy = the weights at the
step start, recomputed as the old log-probs; behaviour = the engine's per-token log-probs) must equal a hand
computation in plain Python floats, token by token:

    w = clamp(pi_prox / mu, tis_clip_low, tis_clip),  r = pi_theta / pi_prox,
    loss = mean over samples of the token mean of  -w * min(r A, clip(r, 1 - eps, 1 + eps_high) A).
"""

import math

import torch

from slime.backends.loss import LossReducer, MicroBatchTensors, policy_loss
from slime.rollout.fully_async.staleness import batch_staleness
from slime.utils.types import Sample
from tests.helpers.args_helpers import make_args

VOCAB = 11


def policy_log_probs(seed: int, tokens: list[int]) -> list[float]:
    """One policy version: log-probs of `tokens` under random logits (std 1.5, so versions differ visibly)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tokens), VOCAB, generator=generator, dtype=torch.float64) * 1.5
    log_probs = torch.log_softmax(logits, dim=-1)
    return [log_probs[i, t].item() for i, t in enumerate(tokens)]


def hand_loss(samples, prox, current, advantages, clip_low, clip_high, eps, eps_high):
    per_sample = []
    for sample, p, c, a in zip(samples, prox, current, advantages):
        terms = []
        for mu, lp, lc, m in zip(sample.rollout_log_probs, p, c, sample.loss_mask):
            if not m:
                continue
            w = min(max(math.exp(lp - mu), clip_low), clip_high)
            r = math.exp(lc - lp)
            terms.append(-w * min(r * a, min(max(r, 1 - eps), 1 + eps_high) * a))
        per_sample.append(sum(terms) / len(terms))
    return sum(per_sample) / len(per_sample)


def test_importance_weights_of_a_mixed_version_batch_match_a_hand_computation():
    args = make_args("--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.6", "--eps-clip", "0.2",
                     "--eps-clip-high", "0.28", "--fully-async")
    tokens = [[3, 7, 1, 9, 4, 2, 8], [5, 5, 0, 6, 10]]
    versions = [["3", "3", "3", "4", "4", "4", "4"], ["5"] * 5]  # sample 0 was cut by the push of version 4
    samples = []
    for i, (toks, vers) in enumerate(zip(tokens, versions)):
        sample = Sample(index=i, tokens=[1, 2] + toks, response_length=len(toks), loss_mask=[1] * len(toks))
        sample.loss_mask[2 if i == 0 else 4] = 0  # a token the policy did not sample (say, tool output)
        sample.token_weight_versions = list(vers)
        sample.rollout_log_probs = [policy_log_probs(int(v), toks)[j] for j, v in enumerate(vers)]
        samples.append(sample)
    trained_version = 5
    prox = [policy_log_probs(trained_version, t) for t in tokens]  # the weights at the step start
    current = [[lp + 0.3 * math.sin(3 * j + i) for j, lp in enumerate(p)] for i, p in enumerate(prox)]
    advantages = [0.8, -1.3]

    loss_masks = [torch.tensor(s.loss_mask, dtype=torch.float64) for s in samples]
    log_probs = torch.tensor([x for c in current for x in c], dtype=torch.float64, requires_grad=True)
    batch = MicroBatchTensors(
        loss_masks=loss_masks,
        advantages=torch.tensor([a for a, t in zip(advantages, tokens) for _ in t], dtype=torch.float64),
        old_log_probs=torch.tensor([x for p in prox for x in p], dtype=torch.float64),
        rollout_log_probs=torch.tensor([x for s in samples for x in s.rollout_log_probs], dtype=torch.float64),
        total_lengths=[len(s.tokens) for s in samples])
    loss, metrics = policy_loss(args, log_probs, torch.zeros_like(log_probs), batch,
                                LossReducer(args, loss_masks, global_denominator=2.0))
    expected = hand_loss(samples, prox, current, advantages, 0.6, 1.5, 0.2, 0.28)
    assert abs(loss.item() - expected) < 1e-12

    # the weights are not all inside the clip range, else the clamp would go untested
    raw = [math.exp(p - mu) for s, ps in zip(samples, prox) for p, mu in zip(ps, s.rollout_log_probs)]
    assert any(w < 0.6 for w in raw) and any(w > 1.5 for w in raw) and any(0.6 < w < 1.5 for w in raw)
    assert metrics["tis_clipfrac"].item() > 0

    # the gradient flows through r only (the weights are constants), as the hand formula's derivative says
    loss.backward()
    eps_grad = 1e-6
    for index in (0, 4, 8):
        bumped = [list(c) for c in current]
        sample_index, token_index = (0, index) if index < len(tokens[0]) else (1, index - len(tokens[0]))
        bumped[sample_index][token_index] += eps_grad
        numeric = (hand_loss(samples, prox, bumped, advantages, 0.6, 1.5, 0.2, 0.28) - expected) / eps_grad
        assert abs(log_probs.grad[index].item() - numeric) < 1e-5

    staleness = batch_staleness(samples, trained_version)
    assert (staleness.max, staleness.max_versions_per_sample) == (2, 2)
    # trained tokens: sample 0 has versions 3,3 (the masked one is skipped),4,4,4,4; sample 1 four of version 5
    assert staleness.num_tokens == 10 and abs(staleness.mean - (2 + 2 + 1 * 4 + 0 * 4) / 10) < 1e-12
