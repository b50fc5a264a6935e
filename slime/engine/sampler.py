"""Batched on-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, and the log-prob of
the sampled token under log_softmax(logits / temperature) before any filtering (temperature 0 counts as 1), the
same quantity the trainer computes, so rollout and train log-probs are comparable.

The draw is Gumbel-max: argmax(logits / T + g) with Gumbel noise g hashed from (request seed, output position,
vocabulary index), so a request's samples depend only on its seed, never on the batch it shares. On CUDA, without
top-k / top-p / min-p or banned tokens, one fused Triton kernel (`triton_sampler.py`) does it all in one pass over
the LM head's bf16 logits; with them, the filters run here in torch and the kernel draws from the filtered logits.
Elsewhere the torch path below (float64 noise) is the reference; it and the kernel (float32 noise) pick the same
token except where a row's two best scores lie within float32 rounding. Not responsible for stop conditions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device (built by the model runner).

    temperatures: 0 for greedy rows. top_ks: vocab size when off. top_ps: 1 when off. min_ps: 0 when off.
    seeds, steps: noise counter per row (request seed, number of tokens generated so far).
    banned_rows / banned_token_ids: (row, token) pairs masked out of sampling (stop tokens under min_new_tokens).
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    banned_rows: torch.Tensor
    banned_token_ids: torch.Tensor
    needs_filtering: bool  # any row with top_k / top_p / min_p active
    all_greedy: bool | None = None  # every temperature is 0; None = read it from the tensor (a host sync)
    any_greedy: bool = True  # some temperature is 0 (False lets sampling skip the greedy argmax)


def _hash32(x):
    """A 32-bit integer mixer on int64 tensors or numpy arrays (values stay below 2**63, so no overflow)."""
    x = x & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def noise_row_keys(seeds, steps):
    """[num_rows] 32-bit keys of each row's noise (int64 tensor or numpy array)."""
    return _hash32(_hash32(seeds) ^ _hash32(steps * 0x9E3779B1 + 0x7F4A7C15))


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] Exp(1) samples -log(u), u = (hash + 0.5) / 2**32, a pure function of (seed, step,
    column), float64."""
    if seeds.device.type == "cpu":  # the same integer arithmetic in numpy: a fraction of torch's per-op cost here
        bits = _noise_bits(seeds.numpy(), steps.numpy(), np.arange(vocab_size, dtype=np.int64))
        return torch.from_numpy(-np.log((bits.astype(np.float64) + 0.5) / 2.0**32))
    bits = _noise_bits(seeds, steps, torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))
    return -torch.log((bits.double() + 0.5) / 2.0**32)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] Gumbel(0, 1) samples -log(Exp(1)), float64: argmax(logits + g) draws from
    softmax(logits) (the Gumbel-max trick)."""
    return -torch.log(exponential_noise(seeds, steps, vocab_size))


def temperature_divisors(temperatures: torch.Tensor) -> torch.Tensor:
    """What the logits are divided by: the temperature, or 1 for a greedy row (T = 0)."""
    return torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)


def draw_scores(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor) -> torch.Tensor:
    """float64 [rows, vocab]: logits / T + g, or the logits for a greedy row (T = 0); the drawn token is the
    argmax. The reference of the fused kernel (tests compare against it)."""
    is_greedy = temperatures == 0
    scaled = logits.float() / temperature_divisors(temperatures)[:, None]
    noise = gumbel_noise(seeds, steps, logits.shape[-1]).to(logits.device)
    return scaled.double() + torch.where(is_greedy[:, None], torch.zeros_like(noise), noise)


def _noise_bits(seeds, steps, columns):
    """32-bit hashes of (seed, step, column), [num_rows, num_columns], on int64 torch tensors or numpy arrays."""
    row_key = noise_row_keys(seeds, steps)
    return _hash32(_hash32(row_key[:, None] ^ columns[None, :]) + row_key[:, None])


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [num_rows, vocab] (any float dtype; the math is float32) -> (token ids [num_rows], log-probs)."""
    if _fused_alone(logits, batch):
        from slime.engine.triton_sampler import fused_sample

        return fused_sample(logits, batch.temperatures, batch.seeds, batch.steps)
    fused = logits.is_cuda and _triton_sampler_available()
    is_greedy = batch.temperatures == 0
    scaled = logits.float() / temperature_divisors(batch.temperatures)[:, None]

    sampling_logits = scaled
    if batch.banned_rows.numel():
        sampling_logits = sampling_logits.clone()
        sampling_logits[batch.banned_rows, batch.banned_token_ids] = float("-inf")
    all_greedy = batch.all_greedy if batch.all_greedy is not None else bool(is_greedy.all())
    greedy_tokens = sampling_logits.argmax(dim=-1) if batch.any_greedy or all_greedy else None
    if all_greedy:
        tokens = greedy_tokens
    else:
        if batch.needs_filtering:
            sampling_logits = _filter(sampling_logits, batch)
        if fused:  # the logits are scaled already: draw at temperature 1 (0 keeps greedy rows greedy)
            from slime.engine.triton_sampler import fused_sample

            sampled_tokens, _ = fused_sample(sampling_logits, (~is_greedy).float(), batch.seeds, batch.steps)
        else:
            noise = gumbel_noise(batch.seeds, batch.steps, logits.shape[-1])
            sampled_tokens = (sampling_logits.double() + noise).argmax(dim=-1)
        tokens = torch.where(is_greedy, greedy_tokens, sampled_tokens) if batch.any_greedy else sampled_tokens
    # log_softmax at the sampled token only, without materialising [num_rows, vocab] log-probs
    log_probs = scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    return tokens, log_probs


def sample_results(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sample`, returning (token ids [num_rows], results [2, num_rows] float64: the token ids, exact in float64,
    and the log-probs), the layout of the copy to the host; the fused path writes the results in its own kernel."""
    if _fused_alone(logits, batch):
        from slime.engine.triton_sampler import fused_sample_results

        return fused_sample_results(logits, batch.temperatures, batch.seeds, batch.steps)
    tokens, log_probs = sample(logits, batch)
    return tokens, torch.stack([tokens.double(), log_probs.double()])


def _fused_alone(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Whether the fused kernel does the whole draw: on CUDA, no top-k / top-p / min-p and no banned tokens."""
    return (logits.is_cuda and not batch.needs_filtering and not batch.banned_rows.numel()
            and _triton_sampler_available())


def near_tie_rows(scores: torch.Tensor, tolerance: float = 1e-4) -> torch.Tensor:
    """[rows] bool: rows whose two best draw scores lie within `tolerance`, where float32 and float64 noise may
    pick different tokens."""
    top2 = scores.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) <= tolerance


@functools.cache
def _triton_sampler_available() -> bool:
    """Whether the fused Triton sampler imports, compiles and agrees with the torch reference on this machine."""
    try:
        from slime.engine.triton_sampler import fused_sample

        logits = (torch.arange(3 * 2000, device="cuda", dtype=torch.float32).reshape(3, 2000) * 0.37).sin() * 4
        temperatures = torch.tensor([1.0, 0.7, 0.0], device="cuda")
        seeds, steps = torch.tensor([3, 4, 5], device="cuda"), torch.tensor([1, 0, 9], device="cuda")
        tokens, log_probs = fused_sample(logits, temperatures, seeds, steps)
        scores = draw_scores(logits, temperatures, seeds, steps)
        agree = (tokens == scores.argmax(-1)) | near_tie_rows(scores)
        expected = torch.log_softmax(logits / temperature_divisors(temperatures)[:, None], -1).gather(1, tokens[:, None]).squeeze(1)
        return bool(agree.all()) and bool(torch.allclose(log_probs, expected, atol=1e-4))
    except Exception:  # noqa: BLE001
        return False


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf what top-k, top-p and min-p remove (per row), on temperature-scaled logits."""
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    remove = ranks >= batch.top_ks[:, None]
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Remove a token when the tokens ranked above it already reach top_p (the top token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before > batch.top_ps[:, None]
    remove |= sorted_probs < batch.min_ps[:, None] * sorted_probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)
