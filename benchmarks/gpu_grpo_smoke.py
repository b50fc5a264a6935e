"""One GRPO run on one GPU, colocated, with a Qwen3-0.6B-shaped model (random init, quickstart tokenizer and
vocabulary): a few rollouts through train.py, then the per-step time breakdown as a table and a JSON last line."""
import json, subprocess, sys
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from examples.quickstart.task import build_task
import examples.quickstart.task as task_mod
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
task_mod.MODEL_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
paths = build_task(out / "task")
cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(paths["model"]), "--ref-load", str(paths["model"]),
       "--prompt-data", str(paths["train"]), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
       "--rm-type", "math", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-rollout", "3",
       "--rollout-max-response-len", "256", "--colocate", "--actor-num-gpus-per-node", "1", "--use-kl-loss",
       "--kl-loss-coef", "0.001", "--micro-batch-size", "16", "--lr", "1e-6", "--output-dir", str(out / "run"), "--no-progress"]
print(" ".join(cmd), flush=True)
rc = subprocess.run(cmd, cwd=REPO).returncode
rows = [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines()] if (out / "run" / "metrics.jsonl").exists() else []
keys = ["perf/rollout_time", "perf/log_prob_time", "perf/train_time", "perf/update_weights_time", "perf/step_time",
        "train/train_rollout_logprob_abs_diff", "rollout/response_len/mean"]
for r in rows:
    print(r["rollout_id"], " ".join(f"{k.split('/')[-1]}={r.get(k, float('nan')):.4g}" for k in keys))
print(json.dumps({"rc": rc, "rows": [{k: r.get(k) for k in ["rollout_id"] + keys} for r in rows]}))
