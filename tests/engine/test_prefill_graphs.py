"""Piecewise prefill graphs (prefill_graphs.py): the split of the forward into pieces around the attention, and the
padding of a step to its bucket, must give what the model's own forward gives and write the same K/V, padded rows
going only to the scratch slot. On the CPU the pieces run eagerly (use_graphs=False); the marked tests capture and
replay them on CUDA, against the eager forward and through whole generations."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slime.engine.engine import Engine
from slime.engine.prefill_graphs import PrefillGraphs, bucket_token_counts
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.utils.tiny_model import build_tiny_model


def test_buckets_double_to_1024_then_step_by_1024_and_end_at_the_budget():
    assert bucket_token_counts(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert bucket_token_counts(100) == [16, 32, 64, 112]  # the budget rounded up to a multiple of 16
    assert bucket_token_counts(2500)[-3:] == [1024, 2048, 2512]
    assert bucket_token_counts(16) == [16]


def _mixed_batch(vocab_size: int, block_size: int) -> list[ScheduledSequence]:
    """A prefill chunk from the start, a chunk after a cached prefix, and two decode rows: 36 tokens."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    lengths_and_chunks = [(20, 0, 20), (30, 16, 14), (9, 8, 1), (40, 39, 1)]
    scheduled, next_block = [], 0
    for index, (length, start, num_new) in enumerate(lengths_and_chunks):
        tokens = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        seq = Sequence(f"r{index}", tokens, params, index)
        num_blocks = -(-length // block_size)
        seq.block_table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append(ScheduledSequence(seq, start, num_new, start + num_new == length))
    return scheduled


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_pieces_padded_to_their_bucket_equal_the_forward_and_write_the_same_cache(tmp_path, arch):
    engine = Engine(str(build_tiny_model(tmp_path / "m", arch=arch)), device="cpu", num_kvcache_blocks=32)
    runner = engine.model_runner
    scheduled = _mixed_batch(runner.model_config.vocab_size, runner.block_size)
    # Every slot a step reads before it writes it (the cached prefix, the decode rows' contexts) gets values first.
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    input_ids, positions, meta, _ = runner.prepare_inputs(scheduled)
    assert input_ids.shape[0] == 36
    with torch.inference_mode():
        expected = runner.model(input_ids, positions, meta)
        expected_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        pieces = PrefillGraphs(runner.model, 64, runner.scratch_slot, use_graphs=False)
        got = pieces.run(input_ids, positions, meta)  # padded to the 64-token bucket
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    scratch_block = runner.scratch_slot // runner.block_size
    keep = torch.ones(runner.kv_cache.shape[2], dtype=torch.bool)
    keep[scratch_block] = False
    torch.testing.assert_close(runner.kv_cache[:, :, keep], expected_cache[:, :, keep], rtol=1e-5, atol=1e-5)
    assert not torch.equal(runner.kv_cache[:, :, scratch_block], before[:, :, scratch_block])  # padding went there
    if arch == "qwen3_moe":
        assert pieces.layers[0].is_sparse


def test_prefill_graph_flags_are_validated_by_name():
    from slime.engine.config import Config

    with pytest.raises(ValueError, match="prefill_cuda_graphs must be a bool"):
        Config(model="m", prefill_cuda_graphs="yes")
    with pytest.raises(ValueError, match="prefill_cuda_graph_max_tokens must be a positive int"):
        Config(model="m", prefill_cuda_graph_max_tokens=0)
    assert Config(model="m", prefill_cuda_graph_max_tokens=512).prefill_cuda_graph_max_tokens == 512


def test_a_step_past_the_largest_bucket_runs_the_eager_forward(tmp_path):
    engine = Engine(str(build_tiny_model(tmp_path / "m", arch="qwen3")), device="cpu", num_kvcache_blocks=32)
    pieces = PrefillGraphs(engine.model_runner.model, 32, engine.model_runner.scratch_slot, use_graphs=False)
    assert pieces.fits(32) and not pieces.fits(33)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_captured_pieces_replay_the_eager_forward_on_cuda(tmp_path, arch):
    """The graphs replayed at several buckets (and a bucket captured lazily) against the model's forward, with the
    engine's real Triton metadata. The MoE model in bf16: grouped_mm (which a graph can capture) has no fp32."""
    dtype = "bfloat16" if arch == "qwen3_moe" else "float32"
    tolerance = 3e-2 if arch == "qwen3_moe" else 1e-4
    engine = Engine(str(build_tiny_model(tmp_path / "m", arch=arch)), device="cuda", dtype=dtype,
                    num_kvcache_blocks=64, max_num_batched_tokens=64)
    runner = engine.model_runner
    scheduled = _mixed_batch(runner.model_config.vocab_size, runner.block_size)
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    input_ids, positions, meta, _ = runner.prepare_inputs(scheduled)
    with torch.inference_mode():
        expected = runner.model(input_ids, positions, meta).clone()
        for capture_all in (True, False):
            runner.kv_cache.copy_(before)
            graphs = PrefillGraphs(runner.model, 64, runner.scratch_slot, capture_all=capture_all)
            got = graphs.run(input_ids, positions, meta).clone()
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
            assert sorted(graphs.buckets) == ([16, 32, 64] if capture_all else [64])
            first = replace(meta, block_tables=meta.block_tables[:1], query_start_loc=meta.query_start_loc[:2],
                            seq_lens=meta.seq_lens[:1], slot_mapping=meta.slot_mapping[:20])
            again = graphs.run(input_ids[:20], positions[:20], first).clone()  # the first sequence: the 32 bucket
            torch.testing.assert_close(again, expected[:20], rtol=tolerance, atol=tolerance)
            assert 32 in graphs.buckets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_with_prefill_graphs_generates_what_the_eager_engine_does(tmp_path):
    """Greedy generations of prompts long enough to be chunked, through the prefill graphs and without them."""
    model = str(build_tiny_model(tmp_path / "m", arch="qwen3"))
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40 + 13 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    outputs = {}
    for prefill_graphs in (True, False):
        engine = Engine(model, device="cuda", dtype="float32", max_num_batched_tokens=96,
                        prefill_cuda_graphs=prefill_graphs, num_kvcache_blocks=128)
        outputs[prefill_graphs] = [out["token_ids"] for out in engine.generate(prompts, params)]
        assert (engine.model_runner.prefill_graphs is not None) == prefill_graphs
    assert outputs[True] == outputs[False]
    capped = Engine(model, device="cuda", dtype="float32", max_num_batched_tokens=96, num_kvcache_blocks=128,
                    prefill_cuda_graph_max_tokens=40)  # the 96-token chunks run eagerly, the shorter steps not
    assert [out["token_ids"] for out in capped.generate(prompts, params)] == outputs[False]
    assert capped.model_runner.prefill_graphs.sizes == [16, 32, 48]
