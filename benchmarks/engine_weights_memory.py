"""The engine benchmark's side measurements on an engine that has just run a workload: a full weight update from
tensors already on the device, and release / resume of the engine's memory (time and bytes freed). Plus the two
device helpers every measurement here uses. Used by bench_engine.py.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bench_weight_update(engine, model_path: Path, device: str) -> dict:
    """`update_weights_from_tensors` with the full state dict, from tensors already on the engine's device (what
    a colocated trainer hands over by CUDA IPC): every parameter, not the router's correction-bias buffers (GLM-4.5,
    DeepSeek-V3), which no trainer sends and a push refuses."""
    from slime.engine.models.weight_loader import LOADED_BUFFER_SUFFIXES, iterate_checkpoint

    named_tensors = [(name, tensor.to(device)) for name, tensor in iterate_checkpoint(model_path)
                     if not name.endswith(LOADED_BUFFER_SUFFIXES)]
    synchronize(device)
    started = time.perf_counter()
    engine.update_weights_from_tensors(named_tensors, weight_version="bench")
    synchronize(device)
    seconds = time.perf_counter() - started
    num_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)
    del named_tensors
    free_device_memory(device)
    return {"weight_update_seconds": seconds, "weight_update_bytes": num_bytes}


def bench_release_resume(engine, prompts: list[list[int]], device: str) -> dict:
    """Time of release_memory / resume_memory (all tags) and the device bytes they free, then a short generate to
    show the engine works again."""
    from slime.engine.sampling_params import SamplingParams

    def device_free() -> int | None:  # device-wide: the weights and KV cache are mapped outside torch's allocator
        return torch.cuda.mem_get_info()[0] if device == "cuda" else None

    synchronize(device)
    free_before = device_free()
    started = time.perf_counter()
    engine.release_memory()
    synchronize(device)
    release_seconds = time.perf_counter() - started
    free_released = device_free()
    started = time.perf_counter()
    engine.resume_memory()
    synchronize(device)
    resume_seconds = time.perf_counter() - started
    free_resumed = device_free()
    check = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    assert len(check[0]["output_ids"]) == 2, "the engine did not generate after resume_memory"
    on_cuda = device == "cuda"
    return {
        "release_seconds": release_seconds,
        "resume_seconds": resume_seconds,
        "released_device_free_bytes": free_released - free_before if on_cuda else None,
        "resumed_device_bytes": free_released - free_resumed if on_cuda else None,
    }
