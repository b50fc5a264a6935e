"""The FSDP trainer's side of the colocated hand-over on one GPU, alone: `TrainFlow.offload()` (the optimizer state's
and the parameters' copies already started after the last step, as in a run, and done here before the offload is
timed) and `onload()` (returns once the parameters are back; the optimizer state follows on a side stream, which
`onload_all` waits for too), with the bytes each moves and the effective bandwidth. The model is a
random Qwen3-shaped checkpoint with a ref (--use-kl-loss), fp32 master parameters, fused AdamW. Prints one JSON
line of medians, milliseconds. Not a pass/fail test; the device operations alone: handover_primitives.py.

    python benchmarks/bench_trainer_handover.py --model-shape qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_train import SHAPES, build_checkpoint, make_samples


def tensor_bytes(tensors) -> int:
    from slime.backends.fsdp_utils.offload import local_tensor

    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--repeats", type=int, default=4)
    cli = parser.parse_args()
    from slime.backends.factory import create_trainer
    from slime.config.arguments import parse_args
    from slime.utils.misc import find_free_port

    checkpoint = build_checkpoint(cli.model_shape, Path(tempfile.mkdtemp()) / "model")
    tokens, response_lengths, rewards = make_samples(16, 128, 64, 128, SHAPES[cli.model_shape]["vocab_size"])
    args = parse_args(["--hf-checkpoint", str(checkpoint), "--ref-load", str(checkpoint), "--use-kl-loss",
                       "--kl-loss-coef", "0.001", "--rollout-batch-size", str(len(tokens)), "--num-rollout", "10",
                       "--rm-type", "math", "--device", "cuda", "--lr", "1e-6", "--offload-train",
                       "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192"])
    trainer = create_trainer(args, 0, 1, "127.0.0.1", find_free_port())
    trainer.init(with_ref=True)
    data = dict(tokens=tokens, response_lengths=response_lengths, rewards=rewards, raw_reward=rewards,
                loss_masks=[[1] * r for r in response_lengths], num_steps_per_rollout=1,
                global_batch_size=len(tokens))
    optimizer = trainer.backend._optimizer  # not the property: reading sizes must not count as a touch
    times: dict[str, list[float]] = {}
    sizes = {}
    for rollout_id in range(cli.repeats + 1):
        trainer.train(rollout_id, data)  # its last step starts the optimizer state's and the parameters' copies to the host
        torch.cuda.synchronize()
        sizes = {"param_gb": tensor_bytes(trainer.model.parameters()) / 1e9,
                 "optimizer_state_gb": tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                                                    if isinstance(v, torch.Tensor)) / 1e9,
                 "snapshot_device_gb": tensor_bytes(t for store in trainer.snapshot.device_copies.values()
                                                    for t in store.values()) / 1e9}
        start = time.perf_counter()
        trainer.offload()
        offload = time.perf_counter() - start
        start = time.perf_counter()
        trainer.onload()
        onload = time.perf_counter() - start
        torch.cuda.synchronize()
        onload_all = time.perf_counter() - start
        if rollout_id:  # the first round pins the host memory
            for key, seconds in (("offload", offload), ("onload_to_parameters", onload), ("onload_all", onload_all)):
                times.setdefault(key, []).append(seconds)
    medians = {key: statistics.median(values) for key, values in times.items()}
    moved_gb = sum(sizes.values())
    print(json.dumps({"shape": cli.model_shape, "device": torch.cuda.get_device_name(), **sizes,
                      "onload_bytes_gb": trainer.device_room.onload_bytes / 1e9,
                      **{f"{key}_ms": round(seconds * 1e3, 2) for key, seconds in medians.items()},
                      "onload_all_gb_per_s": round(moved_gb / medians["onload_all"], 2)}))


if __name__ == "__main__":
    main()
