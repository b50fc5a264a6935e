"""The engine benchmark's tiny variants run end to end on the CPU: every workload produces the tokens it asks for,
the MBU byte count follows the documented formula, W3's samples hit the prefix cache, and the JSON last line is
the returned result. Correctness only, no timing assertions."""

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_engine


def test_tiny_workloads_run_end_to_end(capsys):
    result = bench_engine.main(["--workload", "all"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    workloads = result["workloads"]
    assert list(workloads) == ["w1", "w2", "w3", "w4", "w5"]
    assert not [name for name, summary in workloads.items() if "warning" in summary]

    w1 = workloads["w1"]
    assert w1["engine_output_tokens"] == w1["hf_output_tokens"] == 16 * 64 and w1["ratio_engine_over_hf"] > 0
    assert result["engine_output_tokens"] == 16 * 64  # the W1 fields stay at the top level
    # Tiny Qwen3 (hidden 64, 2 layers, 4 heads / 2 KV heads of 16, MLP 128, vocab 512, tied), float32.
    layer_params = 64 * 64 * 2 + 32 * 64 * 2 + 16 * 2 + 64 * 2 + 128 * 64 * 3
    weight_bytes = 4 * (512 * 64 + 2 * layer_params + 64)
    assert w1["weight_update_bytes"] == weight_bytes
    kv_bytes_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    kv_token_reads = 16 * sum(32 + k for k in range(1, 64))  # 16 requests, decode steps 1..63 over 32 + k tokens
    assert w1["bytes_read"] == w1["engine_steps"] * weight_bytes + kv_token_reads * kv_bytes_per_token
    assert w1["release_seconds"] >= 0 and w1["resume_seconds"] >= 0

    # W2: nano-vllm's draws (prompts first, then output lengths), scaled to [8, 64].
    rng = random.Random(0)
    prompt_lens = []
    for _ in range(16):
        prompt_lens.append(rng.randint(8, 64))
        [rng.randint(0, 511) for _ in range(prompt_lens[-1])]
    assert workloads["w2"]["num_prompt_tokens"] == sum(prompt_lens)
    assert workloads["w2"]["engine_output_tokens"] == sum(rng.randint(8, 64) for _ in range(16))

    # W3: 7 of 8 samples reuse the 3 whole blocks (48 tokens) before each 64-token prompt's last token.
    w3 = workloads["w3"]
    assert w3["num_requests"] == 32 and w3["prefix_cache_hit_rate"] == w3["prefix_cache_hit_rate_max"]
    assert w3["prefix_cache_hit_rate"] == round(7 * 48 / (8 * 64), 4)

    assert workloads["w4"]["engine_output_tokens"] == 16 * 64
    assert workloads["w4"]["weight_gb"] > w1["weight_gb"]
    # W5: twice W1's batch on W1's tiny shape (its checkpoint rebuilt after W4 dropped it), engine only by default.
    assert workloads["w5"]["num_requests"] == 32 and workloads["w5"]["engine_output_tokens"] == 32 * 64
    assert workloads["w5"]["weight_gb"] == w1["weight_gb"] and workloads["w5"]["hf_output_tok_s"] is None


def test_host_step_benchmark_times_every_decode_step():
    result = bench_engine.bench_host_step(seed=0, num_seqs=8, input_len=16, output_len=32)
    assert result["num_decode_steps"] == 31  # the first output token comes from the prefill step
    assert result["host_ms_per_step_mean"] > 0
    # 8 x 16 prompt tokens, one chunk: its step, and the one that completes it and launches the first decode step
    assert result["num_prefill_steps"] == 2
    parts = {**result["host_ms_per_step_parts"], **result["prefill_host_ms_per_step_parts"]}
    assert parts.keys() == bench_engine.HOST_STEP_PARTS.keys() | bench_engine.PREFILL_STEP_PARTS.keys()
    assert all(milliseconds >= 0 for milliseconds in parts.values())


def test_sharded_random_checkpoint_loads_into_engine_and_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.engine_checkpoints import TINY_SHAPE
    from slime.engine.engine import Engine

    path = bench_engine.build_checkpoint(tmp_path, TINY_SHAPE, torch.float32, "cpu", 0, 100_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(path.glob("*.safetensors"))) > 1
    engine = Engine(str(path), device="cpu", num_kvcache_blocks=16)  # raises on any missing weight
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf_weights = dict(hf.named_parameters())
    for name, (shape, _) in engine.named_weight_shapes().items():
        assert tuple(hf_weights[name].shape) == tuple(shape)
    tokens = [5, 6, 7, 8]
    expected = hf(torch.tensor([tokens])).logits[0, -1].argmax().item()
    greedy = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
    assert engine.generate([tokens], greedy)[0]["output_ids"] == [expected]


def test_quickstart_preset_runs_w1_on_the_quickstart_model():
    """The engine-speed issue's CPU bar is measured on the quickstart's own model (built by its task module)."""
    result = bench_engine.main(["--preset", "quickstart", "--num-prompts", "4", "--input-len", "8",
                                "--output-len", "8"])
    assert result["engine_output_tokens"] == result["hf_output_tokens"] == 32
    assert result["weight_gb"] * 1e9 < 5e6  # the quickstart's tiny Qwen3, not a preset shape
    assert result["ratio_engine_over_hf"] > 0
    with pytest.raises(ValueError, match="--preset quickstart runs --workload w1 only"):
        bench_engine.parse_args(["--preset", "quickstart", "--workload", "w2"])


def test_rollout_io_benchmark_times_paths_that_agree(tmp_path):
    """Each stage's two paths give the same result (JSON decoded; the prompt ids once per group and once per
    sample), so the benchmark compares like with like; the response carries the recorded tokens and log-probs."""
    import bench_rollout_io
    import orjson

    from slime.utils.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "tiny", arch="qwen3"))
    stages = bench_rollout_io.stages(num_samples=2, prompt_len=5, response_len=7, seed=0, model_dir=model_dir)
    per_sample, per_group = stages["client: group prompt ids"]["per sample"](), stages["client: group prompt ids"]["per group"]()
    assert per_group and per_sample == [per_group, per_group]
    for stage, paths in stages.items():
        if "stdlib" in paths:
            stdlib, fast = paths["stdlib"](), paths["orjson"]()
            assert (json.loads(stdlib) if isinstance(stdlib, bytes) else stdlib) == \
                (orjson.loads(fast) if isinstance(fast, bytes) else fast), stage
    prompt, outputs = bench_rollout_io.recorded_outputs(2, 5, 7, seed=0)
    decoded = json.loads(stages["server: encode response"]["orjson"]())
    assert [item[1] for item in decoded[1]["meta_info"]["output_token_logprobs"]] == outputs[1].output_token_ids
    assert [item[0] for item in decoded[1]["meta_info"]["output_token_logprobs"]] == outputs[1].output_log_probs
    assert decoded[0]["text"] == outputs[0].text and prompt == outputs[0].prompt_token_ids
