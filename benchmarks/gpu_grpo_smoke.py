"""A GRPO run through train.py (colocated on one GPU by default; the two-GPU placements of the multi-GPU issue
on request) with the per-rollout step-time breakdown (rollout, log-prob, train, weight sync) as a table and a JSON
last line.

    python benchmarks/gpu_grpo_smoke.py OUT_DIR                    # one GPU: Qwen3-0.6B shape, 32 x 8 samples
    python benchmarks/gpu_grpo_smoke.py OUT_DIR --shape tiny       # CPU: the quickstart model, a quick check
    python benchmarks/gpu_grpo_smoke.py OUT_DIR --placement disaggregated   # trainer GPU 0, engine GPU 1 (NCCL push)
    python benchmarks/gpu_grpo_smoke.py OUT_DIR --placement colocated-2     # FSDP2 over 2 GPUs, 2 engines
    python benchmarks/gpu_grpo_smoke.py OUT_DIR --placement disaggregated --async   # train_async.py
    python benchmarks/gpu_grpo_smoke.py OUT_DIR --shape qwen3-30b-a3b-8l \
        --train-args='--use-rollout-routing-replay --get-mismatch-metrics'   # MoE with R3 (without: no flag)
    python benchmarks/gpu_grpo_smoke.py OUT_DIR --shape moonlight-4l \
        --train-args='--use-rollout-routing-replay --get-mismatch-metrics'   # MLA + grouped sigmoid router, R3

The qwen3-0.6b shape is Qwen3-0.6B's (28 layers, hidden 1024, 151,936 embedding rows) with random weights and the
quickstart's small tokenizer (ids past it decode to nothing), so nothing is downloaded; rewards are ~0, which
does not change the time of any phase. Rollout 0 includes warm-up (CUDA-graph capture, first allocations).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import examples.quickstart.task as task_mod  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, embedding_size=151936),
    # Qwen3-30B-A3B's layer shapes with 8 layers and 64 experts (benchmarks/engine_checkpoints.py); R3 runs on it
    "qwen3-30b-a3b-8l": dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                             num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=8,
                             num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             max_position_embeddings=4096, embedding_size=151936, tie_word_embeddings=False),
    # Moonlight-16B-A3B's layer shapes (MLA: 16 heads, q_lora null, kv_lora 512, nope 128 / rope 64 / v 128; 64
    # experts top-6, 2 shared) cut to 4 of its 27 layers (1 dense + 3 MoE); the built-in engine's latent KV cache
    "moonlight-4l": dict(arch="moonlight", hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                         n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, num_hidden_layers=4,
                         first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096,
                         embedding_size=163840, tie_word_embeddings=False),
    "tiny-mla": dict(task_mod.MODEL_SHAPE, arch="deepseek_v3", num_key_value_heads=4),
    "tiny": dict(task_mod.MODEL_SHAPE),
    "tiny-4k": dict(task_mod.MODEL_SHAPE, max_position_embeddings=4096),  # long responses (bench_fully_async.py)
    "tiny-moe": dict(task_mod.MODEL_SHAPE, arch="qwen3_moe"),
}
PLACEMENTS = {  # the issues' runs: one GPU colocated; two GPUs disaggregated or colocated with FSDP2 over both
    "colocated": ["--colocate", "--actor-num-gpus-per-node", "1"],
    "disaggregated": ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"],
    "colocated-2": ["--colocate", "--actor-num-gpus-per-node", "2"],
}
PHASES = ["perf/rollout_time", "perf/hand_over_to_train_time", "perf/log_prob_time", "perf/actor_train_time",
          "perf/update_weights_time", "perf/weight_push_time", "perf/step_time"]
EXTRA = ["perf/weight_push_gb_per_s", "perf/rollout_tokens_per_sec", "train/train_rollout_logprob_abs_diff",
         "rollout/response_len/mean"]
MOE = ["train/router_agreement", "train/router_agreement_layer_min", "train/mismatch_ratio_p1",
       "train/mismatch_ratio_p99", "train/mismatch_ratio_outside_clip_frac", "train/moe_load_imbalance"]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-rollout", type=int, default=4)
    parser.add_argument("--rollout-batch-size", type=int, default=32)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-response-len", type=int, default=256)
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="colocated")
    parser.add_argument("--async", dest="use_async", action="store_true", help="run train_async.py")
    parser.add_argument("--train-args", default="", help="more train.py flags, e.g. '--compile-model'")
    parser.add_argument("--task-dir", type=Path, default=None,
                        help="where the task (model, data) is built; one built there before is reused, so runs "
                             "of one shape with different flags share it (default: OUT_DIR/task, always built)")
    return parser


def train_command(args, run_dir: Path) -> tuple[list[str], dict]:
    """The train.py (or train_async.py) command of the smoke run writing to `run_dir`, and the task's paths."""
    paths = task_paths(args)
    on_gpu = not args.shape.startswith("tiny")
    driver = "train_async.py" if args.use_async else "train.py"
    cmd = [sys.executable, str(REPO / driver), "--hf-checkpoint", str(paths["model"]),
           "--ref-load", str(paths["model"]), "--prompt-data", str(paths["train"]), "--input-key", "prompt",
           "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
           "--rollout-batch-size", str(args.rollout_batch_size), "--n-samples-per-prompt",
           str(args.n_samples_per_prompt), "--num-rollout", str(args.num_rollout),
           "--rollout-max-response-len", str(args.max_response_len), *PLACEMENTS[args.placement],
           "--use-kl-loss", "--kl-loss-coef", "0.001",
           "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384" if on_gpu else "2048",
           "--lr", "1e-6", "--output-dir", str(run_dir), "--no-progress", *args.train_args.split()]
    return cmd, paths


def task_paths(args) -> dict:
    """The task's model and data: built under --task-dir unless a finished build of the same shape is there."""
    task_dir = args.task_dir or args.out_dir / "task"
    built = task_dir / "shape.json"  # written last: a build cut off half-way is built again
    if args.task_dir is not None and built.exists() and json.loads(built.read_text()) == SHAPES[args.shape]:
        return {"model": task_dir / "model", **{name: task_dir / f"{name}.jsonl" for name in ("sft", "train", "eval")}}
    task_mod.MODEL_SHAPE = SHAPES[args.shape]
    paths = task_mod.build_task(task_dir)
    built.write_text(json.dumps(SHAPES[args.shape]))
    return paths


def read_metrics(run_dir: Path) -> list[dict]:
    metrics_file = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []


def main() -> int:
    args = make_parser().parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    cmd, _ = train_command(args, out / "run")
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO).returncode
    rows = read_metrics(out / "run")
    keys = PHASES + EXTRA + (MOE if "arch" in SHAPES[args.shape] else [])
    print("rollout | " + " | ".join(k.split("/", 1)[1] for k in keys))
    for row in rows:
        print(f"{row['rollout_id']} | " + " | ".join(f"{row.get(k, float('nan')):.4g}" for k in keys))
    summary = {"rc": rc, "shape": args.shape, "placement": args.placement, "async": args.use_async,
               "rows": [{k: r.get(k) for k in ["rollout_id"] + keys} for r in rows]}
    print(json.dumps(summary))
    return rc if rows else 1


if __name__ == "__main__":
    sys.exit(main())
