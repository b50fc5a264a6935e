"""Fault-tolerance soak: a long GRPO run of the quickstart model (two engines, --use-fault-tolerance) with one engine
server SIGKILLed every ~`--kill-every` rollouts, at a random moment of the rollout that follows.

Checks, from the run's metrics.jsonl: every rollout ran and trained on exactly rollout_batch_size x
n_samples_per_prompt samples; the restarts match the kills; the run's memory (RSS of its whole process tree, sampled
every few seconds) stays flat (the median of the last tenth against the median of the second tenth).

    python benchmarks/ft_soak.py --num-rollout 200 --kill-every 20 --out runs/ft_soak

Prints a summary card and a JSON last line; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.quickstart.task import build_task  # noqa: E402

BATCH, N_SAMPLES = 8, 4  # 32 samples a rollout


def tree_rss_mb(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def engine_servers(out: Path, rank: int) -> list[psutil.Process]:
    config = str(out / f"engine_{rank}.json")
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "slime.engine.server" in cmdline and config in cmdline:
            found.append(process)
    return found


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rollout", type=int, default=200)
    parser.add_argument("--kill-every", type=int, default=20)
    parser.add_argument("--out", default="runs/ft_soak")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    out = Path(opts.out).resolve()
    task = build_task(out / "task", seed=opts.seed)
    run_dir = out / "run"
    argv = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(task["model"]),
            "--prompt-data", str(task["train"]), "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--rollout-batch-size", str(BATCH),
            "--n-samples-per-prompt", str(N_SAMPLES), "--num-rollout", str(opts.num_rollout),
            "--rollout-max-response-len", "12", "--lr", "5e-4", "--actor-num-gpus-per-node", "1",
            "--rollout-num-gpus", "2", "--use-fault-tolerance", "--rollout-health-check-interval", "2",
            "--rollout-health-check-timeout", "20", "--max-engine-restarts", str(opts.num_rollout),
            "--output-dir", str(run_dir), "--no-progress"]
    rng = random.Random(opts.seed)
    start = time.monotonic()
    with open(out / "train.log", "w") as log:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    memory, kills, next_kill = [], [], opts.kill_every
    while process.poll() is None:
        time.sleep(2.0)
        memory.append(tree_rss_mb(process.pid))
        done = len(rows(run_dir))
        if done >= next_kill and done < opts.num_rollout - 1:
            time.sleep(rng.uniform(0.0, 2.0))
            rank = rng.randrange(2)
            for server in engine_servers(run_dir, rank):
                server.send_signal(signal.SIGKILL)
                kills.append({"after_rollout": done, "engine": rank, "pid": server.pid})
            next_kill += opts.kill_every
    metrics = rows(run_dir)
    tenth = max(1, len(memory) // 10)
    early, late = statistics.median(memory[tenth:2 * tenth] or memory), statistics.median(memory[-tenth:] or memory)
    result = {
        "returncode": process.returncode, "rollouts": len(metrics), "num_kills": len(kills),
        "engine_failures": sum(r.get("rollout/engine_failures", 0) for r in metrics),
        "engine_restarts": sum(r.get("rollout/engine_restarts", 0) for r in metrics),
        "samples_resent": sum(r.get("rollout/samples_resent", 0) for r in metrics),
        "rollouts_with_wrong_sample_count": [r["rollout_id"] for r in metrics
                                             if r.get("rollout/num_samples") != BATCH * N_SAMPLES],
        "rss_mb_early": round(early), "rss_mb_late": round(late), "minutes": round((time.monotonic() - start) / 60, 1),
        "run_dir": str(run_dir),
    }
    ok = (process.returncode == 0 and result["rollouts"] == opts.num_rollout
          and not result["rollouts_with_wrong_sample_count"] and result["engine_restarts"] == result["num_kills"])
    result["ok"] = ok
    print(f"soak: {result['rollouts']}/{opts.num_rollout} rollouts, {len(kills)} engine kills, "
          f"{result['engine_restarts']} restarts, {result['samples_resent']} samples re-sent, "
          f"RSS {result['rss_mb_early']} -> {result['rss_mb_late']} MB, {result['minutes']} min")
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
