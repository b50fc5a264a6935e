"""DecodeRows (the decode batch's host arrays kept across steps) against the same arrays built from scratch, every
decode step of a scheduler run that preempts (a small KV pool), admits requests mid-run, finishes sequences at
random steps (EOS, lengths) and schedules ahead (overlapped scheduling's look-ahead), with per-request sampling
parameters; and the sampling inputs built from those rows (reused across steady steps) against prepare_sampling's
from the sequences. No model: the sampled tokens come from a seeded RNG."""

import random

import numpy as np
import pytest
import torch

from slime.engine.block_manager import BlockManager
from slime.engine.decode_rows import DecodeRows, sampling_values
from slime.engine.host_staging import HostStaging
from slime.engine.sampling_inputs import DecodeSampling, prepare_sampling
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.scheduler import Scheduler
from slime.engine.sequence import Sequence

VOCAB = 50
EOS = 3


def expected_rows(seqs):
    width = max(len(seq.block_table) for seq in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for row, seq in enumerate(seqs):
        tables[row, : len(seq.block_table)] = seq.block_table
    values = [sampling_values(seq.sampling_params, VOCAB) for seq in seqs]
    return tables, values


def check_sampling(decode_sampling: DecodeSampling, rows: DecodeRows, batch) -> object:
    """The sampling inputs DecodeSampling builds from the kept rows (reusing its device tensors while the rows stay)
    equal those prepare_sampling builds from the batch's sequences."""
    got = decode_sampling.build(rows, np.array([item.start for item in batch]))
    expected = prepare_sampling(list(batch), VOCAB, decode_sampling.staging, {EOS})
    for name in ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "steps", "banned_rows", "banned_token_ids"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=0, msg=name)
    for name in ("needs_filtering", "all_greedy", "any_greedy"):
        assert getattr(got, name) == getattr(expected, name), name
    return got


def check(rows: DecodeRows, seqs):
    tables, values = expected_rows(seqs)
    assert not rows.block_tables[:, tables.shape[1]:].any()  # padding past the longest table is block 0
    np.testing.assert_array_equal(rows.block_tables[:, : tables.shape[1]], tables)
    np.testing.assert_array_equal(rows.seeds, [seq.seed for seq in seqs])
    np.testing.assert_array_equal(rows.num_prompt_tokens, [seq.num_prompt_tokens for seq in seqs])
    np.testing.assert_array_equal(rows.float_params, np.array([v[:3] for v in values], dtype=np.float32).T)
    np.testing.assert_array_equal(rows.top_ks, [v[3] for v in values])
    np.testing.assert_array_equal(rows.needs_filtering, [v[4] for v in values])
    np.testing.assert_array_equal(rows.min_new_tokens, [seq.sampling_params.min_new_tokens for seq in seqs])


def random_request(rng: random.Random, index: int) -> Sequence:
    prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 12))]
    params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([-1, 5]),
                            top_p=rng.choice([1.0, 0.9]), max_new_tokens=rng.randint(2, 40),
                            min_new_tokens=rng.choice([0, 2]))
    return Sequence(f"r{index}", prompt, params, seed=rng.getrandbits(32))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("look_ahead", [False, True])
def test_rows_kept_across_steps_equal_rows_built_from_scratch(seed, look_ahead):
    rng = random.Random(seed)
    scheduler = Scheduler(BlockManager(24, 4), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                          eos_token_ids={EOS})
    rows = DecodeRows(VOCAB, 4)
    decode_sampling = DecodeSampling(HostStaging(torch.device("cpu")), {EOS})
    num_added = num_checked = num_reused = 0
    batch = previous = None

    def launch(batch):
        """What the model runner does with the rows when it launches `batch`."""
        nonlocal num_checked, num_reused, previous
        if batch and all(item.num_new_tokens == 1 and item.needs_sample for item in batch):
            seqs = [item.seq for item in batch]
            rows.update(seqs, np.array([item.start for item in batch]))
            check(rows, seqs)
            sampling = check_sampling(decode_sampling, rows, batch)
            num_reused += previous is not None and sampling.seeds is previous.seeds
            num_checked += 1
            previous = sampling
        else:
            rows.clear()  # as the model runner does on an eager (prefill) step
            previous = None

    for _ in range(2000):
        if num_added < 40 and rng.random() < 0.15:
            scheduler.add(random_request(rng, num_added))
            num_added += 1
        if not scheduler.has_unfinished():
            if num_added >= 40:
                break
            continue
        ahead = scheduler.look_ahead(batch) if look_ahead and batch else None
        if ahead is not None:  # launched first; the pending tokens of `batch` land after, as in the engine
            pending, batch = batch, ahead
            launch(batch)
            scheduler.postprocess(pending, [rng.choice([EOS] + list(range(4, VOCAB))) for _ in pending],
                                  [0.0] * len(pending))
        else:
            if batch is not None and look_ahead:
                scheduler.postprocess(batch, [rng.randrange(3, VOCAB) for item in batch if item.needs_sample],
                                      [0.0] * sum(item.needs_sample for item in batch))
            batch = scheduler.schedule()
            launch(batch)
        if not look_ahead:
            sampled = [rng.choice([EOS] + list(range(4, VOCAB))) for item in batch if item.needs_sample]
            scheduler.postprocess(batch, sampled, [0.0] * len(sampled))
            batch = None
    assert num_added == 40 and not scheduler.has_unfinished()
    assert num_checked > 50
    assert num_reused > 10  # steady decode steps reused the rows' sampling tensors


def test_decode_sampling_from_kept_rows_equals_prepare_sampling():
    """Rows under min_new_tokens (banned stop tokens) and rows past it, built once."""
    rng = random.Random(0)
    seqs = [random_request(rng, i) for i in range(12)]
    for seq in seqs:
        for _ in range(rng.randint(0, 3)):  # some rows have generated tokens, some are still under min_new_tokens
            seq.append_token(rng.randrange(4, VOCAB), -1.0)
        seq.block_table = [rng.randrange(24) for _ in range(-(-len(seq) // 4))]
    batch = [ScheduledSequence(seq, len(seq) - 1, 1, True) for seq in seqs]
    rows = DecodeRows(VOCAB, 4)
    rows.update(seqs, np.array([item.start for item in batch]))
    got = check_sampling(DecodeSampling(HostStaging(torch.device("cpu")), {EOS}), rows, batch)
    assert got.banned_rows.numel() > 0  # the min_new_tokens path is exercised
