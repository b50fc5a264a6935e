"""Greedy tokens compared across two computation paths (engine vs transformers, chunked vs whole prefill, one batch
shape vs another) are equal only when no step is a near-tie: rounding that differs between CPUs (AVX2 vs AVX-512)
or between kernel shapes may pick either of two logits closer than the rounding. `assert_clear_greedy_margin`
checks that precondition on the reference path, so a comparison of greedy tokens fails only for a real mismatch
(logits differing by more than the margin), never for the machine it runs on."""

import torch

# Engine logits match transformers' within 1e-4 in fp32 (test_engine_models); ten times that is a clear choice.
GREEDY_MARGIN = 1e-3


def top2_gaps(hf_model, prompt: list[int], output_ids: list[int]) -> torch.Tensor:
    """Gap between the largest and second-largest logit at each step that produced `output_ids`."""
    tokens = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        logits = hf_model(tokens).logits[0, len(prompt) - 1 : -1].float()
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def assert_clear_greedy_margin(hf_model, prompt: list[int], output_ids: list[int], margin: float = GREEDY_MARGIN):
    gaps = top2_gaps(hf_model, prompt, output_ids)
    step = int(gaps.argmin())
    assert float(gaps[step]) > margin, (
        f"greedy step {step} is a near-tie (top-2 logit gap {float(gaps[step]):.2e} <= {margin}): the test data must "
        "keep every greedy choice clear of rounding; change the prompt or the model seed"
    )
