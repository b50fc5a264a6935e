"""Scheduler + block manager with a fake model runner (no torch): prefix sharing, chunked prefill, preemption by
recompute, abort, and block accounting. The fake runner keeps a simulated KV cache (the token id written at each
slot) and checks, every step, that each sequence's block table really holds its tokens."""

import sys

import pytest

from slime.engine.block_manager import BlockManager
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.scheduler import Scheduler
from slime.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

VOCAB = 97
EOS = 3


class FakeRunner:
    def __init__(self, block_manager: BlockManager):
        self.block_size = block_manager.block_size
        self.cache = [None] * (block_manager.num_blocks * self.block_size)
        self.num_forward_tokens = []

    def slot(self, seq, pos):
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, scheduled):
        self.num_forward_tokens.append(sum(item.num_new_tokens for item in scheduled))
        for item in scheduled:  # write every new token's "KV" first, as the attention layers do
            for pos in range(item.start, item.start + item.num_new_tokens):
                self.cache[self.slot(item.seq, pos)] = item.seq.token_ids[pos]
        tokens = []
        for item in scheduled:
            seq, end = item.seq, item.start + item.num_new_tokens
            assert [self.cache[self.slot(seq, pos)] for pos in range(end)] == seq.token_ids[:end]
            if item.needs_sample:
                tokens.append(hash(tuple(seq.token_ids)) % (VOCAB - 10) + 10)  # never EOS
        return tokens


def make(num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256):
    block_manager = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len, {EOS})
    return scheduler, block_manager, FakeRunner(block_manager)


def check_ref_counts(scheduler, block_manager):
    held = {}
    for seq in scheduler.running:
        for block_id in seq.block_table:
            held[block_id] = held.get(block_id, 0) + 1
    for block in block_manager.blocks:
        assert block.ref_count == held.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in block_manager.free_block_ids)


def drive(scheduler, block_manager, runner, max_steps=10_000):
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        scheduled = scheduler.schedule()
        assert scheduled
        tokens = runner.run(scheduled)
        scheduler.postprocess(scheduled, tokens, [-1.0] * len(tokens))
        check_ref_counts(scheduler, block_manager)
    raise AssertionError("did not finish")


def new_seq(rid, prompt, max_new_tokens=10, **params):
    return Sequence(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, **params), seed=0)


def test_n_samples_share_prompt_blocks():
    scheduler, block_manager, runner = make(num_blocks=64)
    prompt = list(range(10, 40))  # 30 tokens: 7 full blocks of 4, only the first 29 tokens may hit
    seqs = [new_seq(f"s{i}", prompt, max_new_tokens=5) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    scheduled = scheduler.schedule()
    assert [item.num_new_tokens for item in scheduled] == [30, 2, 2, 2]
    shared = seqs[0].block_table[:7]
    for seq in seqs[1:]:
        assert seq.block_table[:7] == shared
        assert seq.num_cached_tokens == 28
    assert seqs[0].num_cached_tokens == 0
    assert all(block_manager.blocks[b].ref_count == 4 for b in shared)
    tokens = runner.run(scheduled)
    scheduler.postprocess(scheduled, tokens, [0.0] * 4)
    drive(scheduler, block_manager, runner)
    assert all(seq.finish_reason == {"type": "length", "length": 5} for seq in seqs)
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_later_request_hits_cache_of_finished_one():
    scheduler, block_manager, runner = make(num_blocks=64)
    first = new_seq("a", list(range(10, 27)))
    scheduler.add(first)
    drive(scheduler, block_manager, runner)
    second = new_seq("b", list(range(10, 27)) + [50, 51])
    scheduler.add(second)
    scheduler.schedule()
    assert second.num_cached_tokens == 16
    block_manager.flush()
    third = new_seq("c", list(range(10, 27)))
    block_manager.admit(third)
    assert third.num_cached_tokens == 0


def outputs_of(num_blocks, prompts, max_num_batched_tokens=64):
    scheduler, block_manager, runner = make(num_blocks, max_num_batched_tokens=max_num_batched_tokens)
    seqs = [new_seq(f"r{i}", p, max_new_tokens=24) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    drive(scheduler, block_manager, runner)
    assert block_manager.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in block_manager.blocks)
    return seqs, runner


def test_preemption_by_recompute_gives_same_outputs():
    prompts = [[11 + i, 12, 13 + i, 14, 15, 16 + i, 17] for i in range(6)]
    reference, _ = outputs_of(256, prompts)
    assert all(seq.num_preemptions == 0 for seq in reference)
    squeezed, _ = outputs_of(16, prompts)  # 16 blocks of 4 = 64 slots for 6 sequences of 31 tokens
    assert sum(seq.num_preemptions for seq in squeezed) > 0
    for ref, seq in zip(reference, squeezed):
        assert seq.token_ids == ref.token_ids
        assert seq.finish_reason == {"type": "length", "length": 24}


def test_chunked_prefill_respects_token_budget():
    seqs, runner = outputs_of(64, [list(range(10, 60)), list(range(20, 45))], max_num_batched_tokens=16)
    assert max(runner.num_forward_tokens) <= 16
    assert runner.num_forward_tokens[:4] == [16, 16, 16, 16]  # 75 prompt tokens in 16-token chunks
    assert [seq.num_completion_tokens for seq in seqs] == [24, 24]


def test_max_num_seqs_limits_running():
    scheduler, block_manager, runner = make(num_blocks=64, max_num_seqs=2)
    for i in range(5):
        scheduler.add(new_seq(f"r{i}", [10 + i, 11, 12]))
    scheduler.schedule()
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 3


def test_abort_frees_blocks():
    scheduler, block_manager, runner = make(num_blocks=32)
    running, waiting = new_seq("run", list(range(10, 30))), new_seq("wait", list(range(40, 60)))
    scheduler.add(running)
    scheduled = scheduler.schedule()
    scheduler.postprocess(scheduled, runner.run(scheduled), [-0.5])
    scheduler.add(waiting)
    assert block_manager.num_free_blocks < 32
    scheduler.abort(running)
    scheduler.abort(waiting)
    assert running.finish_reason["type"] == "abort" and running.num_completion_tokens == 1
    assert running.output_log_probs == [-0.5]
    assert running.status == waiting.status == SequenceStatus.FINISHED
    assert not scheduler.has_unfinished()
    assert block_manager.num_free_blocks == 32 and all(b.ref_count == 0 for b in block_manager.blocks)


def test_stop_token_rules():
    scheduler, block_manager, _ = make(num_blocks=32)
    seq = new_seq("s", [10, 11], max_new_tokens=10, min_new_tokens=2, stop_token_ids=[42])
    scheduler.add(seq)
    for token, expected in [(EOS, None), (42, None), (42, {"type": "stop", "matched": 42})]:
        scheduled = scheduler.schedule()
        scheduler.postprocess(scheduled, [token], [0.0])
        assert seq.finish_reason == expected
    ignore = new_seq("i", [10, 11], max_new_tokens=2, ignore_eos=True)
    scheduler.add(ignore)
    for _ in range(2):
        scheduled = scheduler.schedule()
        scheduler.postprocess(scheduled, [EOS], [0.0])
    assert ignore.finish_reason == {"type": "length", "length": 2}
    assert block_manager.num_free_blocks == 32


def test_max_model_len_finishes_with_length():
    scheduler, block_manager, runner = make(num_blocks=32, max_model_len=12)
    seq = new_seq("s", list(range(10, 20)), max_new_tokens=None)
    scheduler.add(seq)
    drive(scheduler, block_manager, runner)
    assert len(seq) == 12 and seq.finish_reason == {"type": "length", "length": 2}


def test_scheduler_imports_no_torch():
    import subprocess

    code = (
        "import sys; import slime.engine.scheduler, slime.engine.block_manager, slime.engine.sequence, "
        "slime.engine.overlap, slime.engine.scheduled_batch; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)


def test_look_ahead_batch_reads_as_its_scheduled_sequences():
    """The DecodeBatch that look_ahead returns (sequences and positions, no per-row objects) reads as the list of
    ScheduledSequence a decode step is: one token at each sequence's placeholder-extended end, sampled; a sequence
    whose pending token ends it by length sits out."""
    scheduler, block_manager, runner = make(num_blocks=64)
    seqs = [Sequence(f"r{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=2 + 4 * (i != 1)), i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()  # the prompts' prefill, which samples each sequence's first token
    scheduler.postprocess(batch, runner.run(batch), [0.0] * len(batch))
    batch = scheduler.schedule()  # a plain decode step: its token is in flight when the next one is scheduled
    ahead = scheduler.look_ahead(batch)
    continuing = [seqs[0], seqs[2]]  # seqs[1] (max_new_tokens=2) ends with the token in flight
    assert ahead.seqs == continuing and ahead.starts == [4, 4]
    assert list(ahead) == [ScheduledSequence(seq, 4, 1, True) for seq in continuing]
    assert ahead[1] == ScheduledSequence(seqs[2], 4, 1, True) and len(ahead) == 2
    assert all(seq.has_placeholder and seq.token_ids[-1] == PLACEHOLDER for seq in continuing)
    finished = scheduler.postprocess(batch, [11, 12, 13], [0.0] * 3)
    assert finished == [seqs[1]] and [seq.token_ids[-1] for seq in continuing] == [11, 13]
    assert not any(seq.has_placeholder for seq in seqs)
