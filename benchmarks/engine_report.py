"""bench_engine.py's report of one workload: the summary dict it prints as JSON, and its human-readable lines. Not
here: the measuring (bench_engine.py, engine_weights_memory.py, engine_host_step.py)."""

from __future__ import annotations

from benchmarks.engine_workloads import Workload

HF_W2_REFERENCE_TOK_S = 635.0  # transformers generate on W2, same H200, measured in an earlier session (FACTS)


def summarize(workload: Workload, engine: dict, hf: dict | None, preset: str) -> dict:
    """One workload's result: the engine's and transformers' rates, their ratio, MBU, and what else was measured."""
    engine_rate = engine["num_output_tokens"] / engine["seconds"]
    hf_rate = hf["num_output_tokens"] / hf["seconds"] if hf else None
    expected_tokens = sum(workload.max_new_tokens)
    summary = {
        "title": workload.title,
        "num_requests": len(workload.prompts),
        "num_prompt_tokens": engine["num_prompt_tokens"],
        "engine_output_tok_s": round(engine_rate, 1),
        "engine_seconds": round(engine["seconds"], 3),
        "engine_output_tokens": engine["num_output_tokens"],
        "engine_steps": engine["num_steps"],
        "overlap_schedule": engine["overlap_schedule"],
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
        "overlap_prefill": engine["overlap_prefill"],
        "prefill_cuda_graphs": engine["prefill_cuda_graphs"],
        "mbu": round(engine["mbu"], 4),
        "weight_gb": round(engine["weight_bytes"] / 1e9, 3),
        "bytes_read": engine["bytes_read"],
        "engine_init_seconds": round(engine["init_seconds"], 2),
        "engine_startup_seconds": round(engine["startup_seconds"], 2),
        "hf_output_tok_s": round(hf_rate, 1) if hf_rate else None,
        "hf_seconds": round(hf["seconds"], 3) if hf else None,
        "hf_output_tokens": hf["num_output_tokens"] if hf else None,
        "ratio_engine_over_hf": round(engine_rate / hf_rate, 3) if hf_rate else None,
    }
    if engine["num_requests_finished"] != len(workload.prompts):
        summary["warning"] = f"{engine['num_requests_finished']} of {len(workload.prompts)} requests finished"
    elif workload.ignore_eos and engine["num_output_tokens"] != expected_tokens:
        summary["warning"] = f"engine produced {engine['num_output_tokens']} tokens, expected {expected_tokens}"
    if workload.name == "w2" and preset == "qwen3-0.6b":
        summary["reference_hf_tok_s_not_measured_here"] = HF_W2_REFERENCE_TOK_S
        summary["reference_ratio_engine_over_hf"] = round(engine_rate / HF_W2_REFERENCE_TOK_S, 2)
    if workload.samples_per_prompt > 1:
        summary["prefix_cache_hit_rate"] = round(engine["num_cached_prompt_tokens"] / engine["num_prompt_tokens"], 4)
        summary["prefix_cache_hit_rate_ideal"] = (workload.samples_per_prompt - 1) / workload.samples_per_prompt
        # Whole blocks only, and the last prompt token is always recomputed (its logits give the first token).
        prompt_len, block_size = len(workload.prompts[0]), engine["block_size"]
        cachable = (prompt_len - 1) // block_size * block_size / prompt_len
        summary["prefix_cache_hit_rate_max"] = round(summary["prefix_cache_hit_rate_ideal"] * cachable, 4)
    for key in ("weight_update_seconds", "weight_update_bytes", "release_seconds", "resume_seconds",
                "released_device_free_bytes", "resumed_device_bytes"):
        if key in engine:
            value = engine[key]
            summary[key] = round(value, 4) if isinstance(value, float) else value
    return summary


def print_workload(summary: dict, flush: bool = False) -> None:
    line = (f"{summary['title']}\n  engine: {summary['engine_output_tok_s']:,.1f} output tok/s, MBU "
            f"{summary['mbu']:.1%} ({summary['engine_output_tokens']} tokens in {summary['engine_seconds']:.2f} s, "
            f"{summary['engine_steps']} steps); start-up {summary['engine_startup_seconds']:.1f} s "
            f"(init {summary['engine_init_seconds']:.1f} s)")
    if summary["hf_output_tok_s"]:
        line += (f"\n  hf generate: {summary['hf_output_tok_s']:,.1f} output tok/s "
                 f"({summary['hf_seconds']:.2f} s); ratio engine / hf: {summary['ratio_engine_over_hf']:.2f}x")
    if "reference_ratio_engine_over_hf" in summary:
        line += (f"\n  REFERENCE ONLY (not measured in this run): transformers did "
                 f"{summary['reference_hf_tok_s_not_measured_here']} tok/s on W2 on this GPU in an earlier session; "
                 f"engine / that = {summary['reference_ratio_engine_over_hf']:.1f}x")
    if "prefix_cache_hit_rate" in summary:
        line += (f"\n  prefix-cache hit rate {summary['prefix_cache_hit_rate']:.3f} of prompt tokens "
                 f"(ideal {summary['prefix_cache_hit_rate_ideal']:.3f}, at most "
                 f"{summary['prefix_cache_hit_rate_max']:.3f} with whole blocks)")
    if "weight_update_seconds" in summary:
        line += (f"\n  weight update (full state dict, on-device tensors): {summary['weight_update_seconds']:.3f} s "
                 f"for {summary['weight_update_bytes'] / 1e9:.2f} GB")
        line += f"\n  release {summary['release_seconds']:.3f} s, resume {summary['resume_seconds']:.3f} s"
        if summary["released_device_free_bytes"] is not None:
            line += (f"; device memory freed {summary['released_device_free_bytes'] / 2**30:.2f} GiB, taken back "
                     f"{summary['resumed_device_bytes'] / 2**30:.2f} GiB")
    if "warning" in summary:
        line += f"\n  WARNING: {summary['warning']}"
    print(line, flush=flush)
