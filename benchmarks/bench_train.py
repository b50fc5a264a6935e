"""One RL (GRPO) training step on variable-length samples: slime's FSDP trainer (packed micro-batches, chunked
log-prob head) against a plain transformers baseline (padded micro-batches, full-vocabulary fp32 logits), same
model, same samples, same optimizer. Prints a summary card and a JSON last line.

    python benchmarks/bench_train.py --model-shape qwen3-0.6b --num-samples 32 --micro-batch-size 8

`--backend megatron` also times the Megatron backend (TP=1, same samples and budget) before the FSDP backend and
reports its MFU as a ratio of FSDP's.

The train step is slime's `TrainFlow.train` over the FSDP backend with one optimizer step per rollout (its PPO loss reuses the step's
own log-probs, so no extra old-log-prob pass); the no-grad log-prob pass (`compute_log_probs`, what the reference
and old-policy passes cost) is timed separately.

Effective tokens/s counts real tokens only (padding is waste). FLOPs of a train step = 6 * params * tokens
(forward 2, backward 4, per parameter per token) + causal attention 6 * layers * length^2 * heads * head_dim per
sample (the half of 12 * L * T^2 * width that the causal mask keeps); the log-prob pass is a third of that (forward
only). MFU = FLOPs / time / peak, peak = 795 TFLOP/s (measured bf16 matmul on one H200).

`--device cpu` runs the same comparison on the CPU in fp32 (the quickstart's case: `--model-shape quickstart
--num-samples 128 --prompt-length 30 --min-response 1 --max-response 12 --max-tokens-per-gpu 4096`); MFU is then
not meaningful. `--attn-implementation sdpa` gives slime's trainer transformers' sdpa over the packed row (a dense
block-diagonal mask) instead of its own packed attention, for a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_weights_memory import free_device_memory, synchronize

PEAK_FLOPS = 795e12
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # Qwen3-30B-A3B's layer shapes, 8 of its 48 layers, 64 of its 128 experts (benchmarks/engine_checkpoints.py)
    "qwen3-30b-a3b-8l": dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                             num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=8,
                             num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                             tie_word_embeddings=False),
    # examples/quickstart's model (task.py): 0.8M parameters
    "quickstart": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=300),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}


def peak_memory(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def build_checkpoint(shape: str, out_dir: Path, device: str = "cuda") -> Path:
    from transformers import AutoModelForCausalLM

    from slime.utils.tiny_model import tiny_config

    overrides = dict(SHAPES[shape])
    vocab_size = overrides.pop("vocab_size")
    arch = overrides.pop("arch", "qwen3")
    config = tiny_config(arch, vocab_size=vocab_size, max_position_embeddings=8192, **overrides)
    torch.manual_seed(0)
    with torch.device(device):  # random weights built on the device (bf16 on a GPU: seconds, even for 4B)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(out_dir)
    del model
    free_device_memory(device)
    return out_dir


def make_samples(num_samples, prompt_length, min_response, max_response, vocab_size, seed=0):
    rng = random.Random(seed)
    tokens, response_lengths = [], []
    for _ in range(num_samples):
        response_length = rng.randint(min_response, max_response)
        tokens.append([rng.randrange(3, vocab_size) for _ in range(prompt_length + response_length)])
        response_lengths.append(response_length)
    rewards = [rng.choice([-1.0, 1.0]) for _ in range(num_samples)]
    return tokens, response_lengths, rewards


def active_params(num_params: int, shape: dict) -> int:
    """Parameters one token goes through: an MoE layer's unselected experts do no work."""
    if "num_experts" not in shape:
        return num_params
    unused = shape["num_experts"] - shape["num_experts_per_tok"]
    return num_params - shape["num_hidden_layers"] * unused * 3 * shape["hidden_size"] * shape["moe_intermediate_size"]


def model_flops(num_params, lengths, num_layers, attention_width):
    dense = 6 * num_params * sum(lengths)
    attention = sum(6 * num_layers * length * length * attention_width for length in lengths)  # causal: half of 12
    return dense + attention


def run_slime(checkpoint, tokens, response_lengths, rewards, opts, backend: str = "fsdp"):
    from slime.backends.factory import create_trainer
    from slime.backends.fsdp_utils import backend as fsdp_backend
    from slime.config.arguments import parse_args
    from slime.utils.misc import find_free_port

    if opts.attn_implementation == "sdpa":  # the before of a before/after: transformers' dense-mask sdpa
        fsdp_backend.attention_implementation = lambda: "sdpa"
    device = opts.device
    argv = ["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", str(len(tokens)), "--num-rollout", "10",
            "--rm-type", "math", "--device", device, "--lr", "1e-6", "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", str(opts.max_tokens_per_gpu), "--train-backend", backend]
    if opts.recompute_activations:
        argv.append("--recompute-activations")
    if opts.compile_model:
        argv.append("--compile-model")
    if not opts.reshard_after_forward and backend == "fsdp":
        argv.append("--no-reshard-after-forward")
    if opts.moe_grouped_gemm and backend == "megatron":
        argv.append("--moe-grouped-gemm")
    args = parse_args(argv)
    trainer = create_trainer(args, 0, 1, "127.0.0.1", find_free_port())
    trainer.init(with_ref=False)
    data = dict(tokens=tokens, response_lengths=response_lengths, rewards=rewards, raw_reward=rewards,
                loss_masks=[[1] * r for r in response_lengths], num_steps_per_rollout=1,
                global_batch_size=len(tokens))
    trainer.train(0, data)  # warm-up
    schedule = trainer._schedule(data)
    trainer.compute_log_probs(schedule)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for _ in range(opts.num_iters):
        trainer.compute_log_probs(schedule)
    synchronize(device)
    log_prob_seconds = (time.perf_counter() - start) / opts.num_iters
    if opts.profile:
        from benchmarks.gpu_trace import busy_microseconds, idle_gaps

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            trainer.train(0, data)
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        busy_us, num_events = busy_microseconds(prof)
        print(f"profiled train step: {wall:.3f} s wall, GPU busy {busy_us / 1e6:.3f} s ({num_events} kernels/copies)")
        for gap_us, before, after in idle_gaps(prof, 12):
            print(f"  GPU idle {gap_us / 1e3:7.2f} ms between {before!r} and {after!r}")
    reset_peak_memory(device)
    start = time.perf_counter()
    for rollout_id in range(opts.num_iters):
        trainer.train(rollout_id + 1, data)
    synchronize(device)
    seconds = (time.perf_counter() - start) / opts.num_iters
    num_params = sum(p.numel() for p in trainer.model.parameters())
    if device == "cuda":
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        print(f"slime: allocator retries (cache flushed to satisfy a cudaMalloc) so far: {retries}")
    return seconds, log_prob_seconds, peak_memory(device), num_params


def release_trainer():
    """Free one backend's trainer before the next builds: its process groups (and Megatron's) and the cache."""
    import gc

    import torch.distributed as dist

    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    torch.cuda.empty_cache()


def run_baseline(checkpoint, tokens, response_lengths, rewards, opts):
    """transformers forward on right-padded micro-batches, fp32 log_softmax over the full logits, the same
    sample-mean GRPO loss; bf16 parameters and fused AdamW (the FACTS.md peer baseline setup; fp32 on the CPU)."""
    from transformers import AutoModelForCausalLM

    device = opts.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa").to(device)
    if opts.recompute_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), fused=device == "cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(tokens), opts.micro_batch_size):
            batch = list(range(start, min(start + opts.micro_batch_size, len(tokens))))
            width = max(len(tokens[i]) for i in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            attention = torch.zeros(len(batch), width, dtype=torch.long)
            loss_mask = torch.zeros(len(batch), width - 1)
            advantages = torch.zeros(len(batch), 1)
            for row, i in enumerate(batch):
                input_ids[row, :len(tokens[i])] = torch.tensor(tokens[i])
                attention[row, :len(tokens[i])] = 1
                loss_mask[row, len(tokens[i]) - response_lengths[i] - 1:len(tokens[i]) - 1] = 1
                advantages[row] = rewards[i]
            input_ids, attention = input_ids.to(device), attention.to(device)
            loss_mask, advantages = loss_mask.to(device), advantages.to(device)
            logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
            log_probs = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(log_probs - log_probs.detach())
            per_token = -advantages * ratio
            loss = ((per_token * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1)).sum() / len(tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()  # warm-up
    synchronize(device)
    reset_peak_memory(device)
    start = time.perf_counter()
    for _ in range(opts.num_iters):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / opts.num_iters, peak_memory(device)


def run_baseline_that_fits(checkpoint, tokens, response_lengths, rewards, opts):
    """The baseline at --micro-batch-size, halved until its full-vocabulary logits fit in memory."""
    import gc

    while True:
        try:
            return run_baseline(checkpoint, tokens, response_lengths, rewards, opts)
        except torch.cuda.OutOfMemoryError:
            if opts.micro_batch_size == 1:
                raise
        opts.micro_batch_size //= 2  # outside the except block, so the failed attempt's tensors can be freed
        print(f"baseline out of memory; retrying with --micro-batch-size {opts.micro_batch_size}")
        gc.collect()
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--min-response", type=int, default=256)
    parser.add_argument("--max-response", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="baseline padded micro-batch (samples)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="slime packed micro-batch budget")
    parser.add_argument("--recompute-activations", action="store_true")
    parser.add_argument("--compile-model", action="store_true", help="slime's --compile-model")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="slime's --[no-]reshard-after-forward")
    parser.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp",
                        help="megatron: the Megatron backend (TP=1) first, then the FSDP backend, in the same run")
    parser.add_argument("--moe-grouped-gemm", action="store_true",
                        help="slime's --moe-grouped-gemm for the Megatron backend's MoE experts (FSDP's are grouped "
                             "anyway)")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print the GPU kernels of one slime step first")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--attn-implementation", choices=["slime_varlen", "sdpa"], default="slime_varlen",
                        help="slime trainer's attention over packed rows (sdpa: the dense-mask path, for comparison)")
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU (or --device cpu)")

    shape = SHAPES[opts.model_shape]
    tokens, response_lengths, rewards = make_samples(opts.num_samples, opts.prompt_length, opts.min_response,
                                                     opts.max_response, shape["vocab_size"])
    lengths = [len(t) for t in tokens]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(opts.model_shape, Path(tmp), opts.device)
        megatron = None
        if opts.backend == "megatron":
            megatron = run_slime(checkpoint, tokens, response_lengths, rewards, opts, "megatron")
            release_trainer()
        slime_s, log_prob_s, slime_mem, num_params = run_slime(checkpoint, tokens, response_lengths, rewards, opts)
        free_device_memory(opts.device)
        base_s, base_mem = (None, None) if opts.skip_baseline else run_baseline_that_fits(
            checkpoint, tokens, response_lengths, rewards, opts)

    width = shape["num_attention_heads"] * shape["head_dim"]
    flops = model_flops(active_params(num_params, shape), lengths, shape["num_hidden_layers"], width)
    log_prob_flops = flops / 3  # forward only: a third of forward + backward
    result = {
        "bench": "train_step", "model_shape": opts.model_shape, "num_params": num_params,
        "num_samples": opts.num_samples, "num_tokens": sum(lengths),
        "device": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu",
        "num_threads": torch.get_num_threads(), "attn_implementation": opts.attn_implementation,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "slime_seconds": slime_s, "slime_tokens_per_s": sum(lengths) / slime_s,
        "slime_mfu": flops / slime_s / PEAK_FLOPS, "slime_peak_memory_gb": slime_mem / 2**30,
        "max_tokens_per_gpu": opts.max_tokens_per_gpu, "recompute_activations": opts.recompute_activations,
        "compile_model": opts.compile_model, "reshard_after_forward": opts.reshard_after_forward,
        "backend": opts.backend, "moe_grouped_gemm": opts.moe_grouped_gemm,
        "log_prob_seconds": log_prob_s, "log_prob_tokens_per_s": sum(lengths) / log_prob_s,
        "log_prob_mfu": log_prob_flops / log_prob_s / PEAK_FLOPS, "log_prob_over_train_speed": slime_s / log_prob_s,
    }
    if megatron is not None:
        megatron_s, megatron_log_prob_s, megatron_mem, _ = megatron
        result.update(megatron_seconds=megatron_s, megatron_tokens_per_s=sum(lengths) / megatron_s,
                      megatron_mfu=flops / megatron_s / PEAK_FLOPS, megatron_peak_memory_gb=megatron_mem / 2**30,
                      megatron_log_prob_tokens_per_s=sum(lengths) / megatron_log_prob_s,
                      megatron_over_fsdp_mfu=slime_s / megatron_s)
    if base_s is not None:
        result.update(baseline_seconds=base_s, baseline_tokens_per_s=sum(lengths) / base_s,
                      baseline_mfu=flops / base_s / PEAK_FLOPS, baseline_peak_memory_gb=base_mem / 2**30,
                      speedup=base_s / slime_s, baseline_micro_batch_size=opts.micro_batch_size)
    print(f"=== train step: {opts.model_shape} ({num_params / 1e6:.0f}M params), {opts.num_samples} samples, "
          f"{sum(lengths)} tokens ===")
    print(f"slime packed   : {result['slime_tokens_per_s']:>10.0f} tok/s  MFU {result['slime_mfu']:.1%}  "
          f"peak {result['slime_peak_memory_gb']:.1f} GiB")
    print(f"slime log-prob : {result['log_prob_tokens_per_s']:>10.0f} tok/s  MFU {result['log_prob_mfu']:.1%}  "
          f"({result['log_prob_over_train_speed']:.2f}x the train step's tok/s)")
    if megatron is not None:
        print(f"slime megatron : {result['megatron_tokens_per_s']:>10.0f} tok/s  MFU {result['megatron_mfu']:.1%}  "
              f"peak {result['megatron_peak_memory_gb']:.1f} GiB  ({result['megatron_over_fsdp_mfu']:.2f}x FSDP's MFU)")
    if base_s is not None:
        print(f"HF padded      : {result['baseline_tokens_per_s']:>10.0f} tok/s  MFU {result['baseline_mfu']:.1%}  "
              f"peak {result['baseline_peak_memory_gb']:.1f} GiB")
        print(f"speedup        : {result['speedup']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
