"""The absorbed-MLA Triton kernel against the engine's torch path over the same paged latent cache and against a
float64 reference: decode tokens (with and without split-KV), a prefill chunk over a cached prefix, a fresh prefill,
a padded CUDA-graph row (seq_len 0), non-power-of-two latent and rope dims (the tiny test models' 16 + 8, GLM-4.7's
and DeepSeek's 512 + 64 on a GPU).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) on small
fp32 shapes; with CUDA compiled, fp32 and bf16 (`-m gpu` selects the DeepSeek-shaped case)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from slime.engine.host_staging import HostStaging
from slime.engine.layers.latent_attention import LatentPagedAttention
from slime.engine.layers.triton_mla_decode import MLA_DECODE_CONFIG, mla_attention
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence
from slime.engine.step_inputs import flat_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, cache, block_tables, query_lens, seq_lens, scale, latent_dim):
    """Per sequence: its latent rows gathered token by token, causal softmax attention in float64, V = the latent."""
    block_size = cache.shape[1]
    outputs, start = [], 0
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        queries = q.cpu()[start : start + query_len].double()
        start += query_len
        if seq_len == 0:
            outputs.append(torch.zeros(query_len, q.shape[1], latent_dim, dtype=torch.float64))
            continue
        positions = torch.arange(seq_len)
        blocks = block_tables[seq, positions // block_size].long().cpu()
        rows = cache.cpu()[blocks, positions % block_size, 0].double()  # [seq_len, latent + rope]
        scores = torch.einsum("qhd,kd->hqk", queries, rows) * scale
        query_positions = torch.arange(seq_len - query_len, seq_len)
        scores = scores.masked_fill(positions[None, None, :] > query_positions[None, :, None], float("-inf"))
        outputs.append(torch.einsum("hqk,kd->qhd", scores.softmax(-1), rows[:, :latent_dim]))
    return torch.cat(outputs)


def make_case(num_heads, latent_dim, rope_dim, query_lens, seq_lens, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    block_size, num_blocks, max_num_blocks = 4, 64, 16
    cache = torch.randn(num_blocks, block_size, 1, latent_dim + rope_dim, generator=generator).to(DEVICE, dtype)
    q = torch.randn(sum(query_lens), num_heads, latent_dim + rope_dim, generator=generator).to(DEVICE, dtype)
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_num_blocks]
    block_tables = block_tables.view(len(seq_lens), max_num_blocks).to(DEVICE, torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=DEVICE)
    return q, cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


CASES = {  # (query lens, seq lens after the step)
    "decode": ([1, 1, 1], [37, 5, 1]),
    "prefill over a prefix, fresh prefill, decode, padded row": ([7, 20, 1, 1], [13, 20, 40, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads,latent_dim,rope_dim", [(4, 16, 8), (3, 24, 8)])
@pytest.mark.parametrize("num_kv_splits", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_mla_kernel_matches_reference(case, num_heads, latent_dim, rope_dim, num_kv_splits, dtype):
    query_lens, seq_lens = CASES[case]
    if num_kv_splits and (max(query_lens) > 1 or latent_dim & (latent_dim - 1)):
        pytest.skip("split-KV is for decode of a power-of-two latent")
    q, cache, block_tables, query_start_loc, seq_lens_t = make_case(num_heads, latent_dim, rope_dim, query_lens,
                                                                    seq_lens, dtype)
    scale = (latent_dim + rope_dim) ** -0.5
    got = mla_attention(q, cache, block_tables, query_start_loc, seq_lens_t, max(query_lens), scale, latent_dim,
                        num_kv_splits=num_kv_splits)
    expected = reference(q, cache, block_tables, query_lens, seq_lens, scale, latent_dim)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_mla_kernel_equals_torch_path():
    """The engine's two paths over one cache, each with the metadata the model runner builds for it
    (step_inputs.flat_batch): LatentPagedAttention's torch SDPA and the kernel, on a mixed batch."""
    num_heads, latent_dim, rope_dim = 4, 16, 8
    query_lens, seq_lens = [5, 1, 3], [9, 14, 3]
    q, cache, block_tables, _, _ = make_case(num_heads, latent_dim, rope_dim, query_lens, seq_lens, torch.float32,
                                             seed=3)
    scheduled = []
    for index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        seq = Sequence(f"s{index}", list(range(seq_len)), SamplingParams(), seed=0)
        seq.block_table = block_tables[index, : -(-seq_len // cache.shape[1])].tolist()
        scheduled.append(ScheduledSequence(seq, seq_len - query_len, query_len, True))
    attention = LatentPagedAttention(num_heads, latent_dim, rope_dim, scale=0.2)
    attention.k_cache = attention.v_cache = cache
    staging = HostStaging(torch.device(DEVICE))
    outputs = [attention.attend(q, flat_batch(scheduled, cache.shape[1], staging, use_triton)[2])
               for use_triton in (True, False)]
    assert flat_batch(scheduled, cache.shape[1], staging, True)[2].uses_triton
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (DeepSeek's 128 heads x 576 in the interpreter: minutes)")
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_kernel_deepseek_shape_bf16(num_heads):
    query_lens, seq_lens = [1] * 8, [1000, 3, 517, 64, 65, 2048, 1, 300]
    q = torch.randn(8, num_heads, 576, device=DEVICE, dtype=torch.bfloat16)
    query_start_loc = torch.arange(9, dtype=torch.int32, device=DEVICE)
    block_tables = torch.randperm(8 * 512, device=DEVICE).to(torch.int32).view(8, 512)  # 4-token blocks
    cache = torch.randn(8 * 512 + 1, 4, 1, 576, device=DEVICE, dtype=torch.bfloat16)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = 192**-0.5
    got = mla_attention(q, cache, block_tables, query_start_loc, seq_lens_t, 1, scale, 512, config=MLA_DECODE_CONFIG)
    expected = reference(q, cache, block_tables, query_lens, seq_lens, scale, 512)
    torch.testing.assert_close(got.cpu().double(), expected, atol=2e-2, rtol=2e-2)


def test_engine_on_the_kernel_matches_transformers(tmp_path):
    """The whole engine with its attention on the kernel (interpreted on a CPU) against transformers: a prefill
    chunk, a second chunk over the cached prefix, then decode tokens."""
    from transformers import AutoModelForCausalLM

    from slime.engine.engine import Engine
    from tests.helpers.mla_checkpoints import build_mla_checkpoint

    path, _ = build_mla_checkpoint(tmp_path, "deepseek_v3")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = Engine(str(path), device=DEVICE, dtype="float32", kvcache_block_size=4, num_kvcache_blocks=32,
                    enforce_eager=True)
    engine.model_runner.set_use_triton(True)  # the fused RMSNorm / SiLU kernels too (kv_a_layernorm reads a strided view)
    token_ids = [(5 * i + 2) % engine.model_config.vocab_size for i in range(16)]
    seq = Sequence("s", token_ids, SamplingParams(), seed=0)
    logits = []
    for num_new_tokens in (9, 4, 1, 1, 1):
        end = seq.num_computed_tokens + num_new_tokens
        engine.block_manager.grow(seq, end)
        logits.append(engine.model_runner.forward_logits([ScheduledSequence.of(seq, num_new_tokens)]))
        seq.num_computed_tokens = end
    with torch.no_grad():
        expected = hf(torch.tensor([token_ids])).logits[0]
    assert (torch.cat(logits).cpu() - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("num_heads,latent_dim,rope_dim", [(4, 24, 8), (16, 512, 64)])
def test_start_up_self_check_passes_at_the_models_dims(num_heads, latent_dim, rope_dim):
    from slime.engine.kernel_checks import triton_mla_attention_works

    assert triton_mla_attention_works(torch.device(DEVICE), torch.float32, num_heads, latent_dim, rope_dim)
    if DEVICE == "cuda":
        assert triton_mla_attention_works(torch.device(DEVICE), torch.bfloat16, num_heads, latent_dim, rope_dim)
