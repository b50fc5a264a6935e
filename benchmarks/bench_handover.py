"""The colocated hand-over against a real engine server, part by part (issue 18): POST /release_memory_occupation
(saving the weights, and discarding them as train.py's colocated loop does), /resume_memory_occupation of the
weights and of the KV cache, and a tensor-mode weight push, per bucket, by its parts (building the bucket:
per-tensor copies as before, or one packed buffer; serializing the handles; the POST, i.e. the engine's
deserialize, open, check and copy) and whole through `WeightSender` (packed and pipelined).

This process plays the trainer: it holds a model's weights on the engine's device. Prints one JSON line of
medians over --repeats rounds, in milliseconds. Not a pass/fail test.

    python benchmarks/bench_handover.py /tmp/handover                       # the H200: Qwen3-0.6B shape, bf16
    python benchmarks/bench_handover.py /tmp/handover --shape tiny-large    # CPU, fp32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import SHAPES, TINY_LARGE_SHAPE, build_checkpoint
from slime.backends.push_pipeline import iter_buckets
from slime.backends.weight_sender import WeightSender
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.server.launch import launch_server
from slime.utils.blocking_http import blocking_client
from slime.utils.weight_transport import pack_named_tensors, serialize_named_tensors

ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=[*sorted(SHAPES), "tiny-large"], default="qwen3-0.6b")
    parser.add_argument("--bucket-mb", type=int, default=512, help="--update-weight-buffer-size, in MiB")
    parser.add_argument("--repeats", type=int, default=4)
    cli = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = TINY_LARGE_SHAPE if cli.shape == "tiny-large" else SHAPES[cli.shape]
    checkpoint = cli.out_dir / "model"
    checkpoint.mkdir(parents=True, exist_ok=True)
    build_checkpoint(checkpoint, shape, dtype, device, seed=0)
    weights = [(name, tensor.to(device)) for name, tensor in iterate_checkpoint(checkpoint)]
    bucket_bytes = cli.bucket_mb << 20
    server = launch_server(checkpoint, extra_args=["--device", device], log_path=cli.out_dir / "engine.log")
    try:
        times = measure(server.url, weights, bucket_bytes, device, cli.repeats)
    finally:
        server.stop()
    num_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    print(json.dumps({"shape": cli.shape, "device": device, "gb": round(num_bytes / 1e9, 3), "bucket_mb": cli.bucket_mb,
                      **{k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}}))


def measure(url: str, weights, bucket_bytes: int, device: str, repeats: int) -> dict[str, list[float]]:
    def post(path: str, payload: dict) -> float:
        start = time.perf_counter()
        response = blocking_client().post(url + path, json=payload, timeout=600)
        assert response.status_code == 200, response.text
        return time.perf_counter() - start

    def synced(call):
        start = time.perf_counter()
        result = call()
        if device == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - start

    sender = WeightSender(lambda dtype: iter(weights), on_gpu=device == "cuda", rank=0, bucket_bytes=bucket_bytes,
                          dtype=None)
    sender.connect([url])
    times: dict[str, list[float]] = {}
    add = lambda key, seconds: times.setdefault(key, []).append(seconds)
    for _ in range(repeats):
        add("release", post("/release_memory_occupation", {"tags": ALL_TAGS}))
        add("resume_weights", post("/resume_memory_occupation", {"tags": ["weights"]}))
        for packed in (False, True):
            kind = "packed" if packed else "per_tensor"
            for bucket, is_last in iter_buckets(iter(weights), bucket_bytes):
                build = (lambda b=bucket: pack_named_tensors(b)) if packed else (
                    lambda b=bucket: [(name, tensor.clone()) for name, tensor in b])
                built, seconds = synced(build)
                add(f"bucket_build_{kind}", seconds)
                serialized, seconds = synced(lambda b=built: serialize_named_tensors(b))
                add(f"bucket_serialize_{kind}", seconds)
                add(f"bucket_post_{kind}", post("/update_weights_from_tensor",
                                                {"serialized_named_tensors": [serialized], "flush_cache": is_last}))
                del built
        add("push_weight_sender", sender.update("bench")["seconds"])
        add("resume_kv", post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))
        # train.py's colocated release: the weights dropped (the push overwrites them), their resume an allocation.
        add("release_discarding_weights", post("/release_memory_occupation", {"tags": ALL_TAGS,
                                                                              "discard_weights": True}))
        add("resume_weights_discarded", post("/resume_memory_occupation", {"tags": ["weights"]}))
        add("push_after_discard", sender.update("bench")["seconds"])
        add("resume_kv_after_discard", post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))
    return times


if __name__ == "__main__":
    main()
