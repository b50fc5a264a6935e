"""Engine configuration: one small dataclass with vLLM's knob names, validated on construction.

This is what `Engine(model_path, **config)` accepts. It is not the slime CLI (that lives in
`slime.config.arguments` and turns `--sglang-*` flags into these fields) and it holds no model architecture
facts: those are read from the checkpoint's config.json by `slime.engine.models`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# SGLang's --kv-cache-dtype spellings (less fp4) plus the torch names; slime.engine.dtypes maps them to torch dtypes.
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2")


@dataclass
class Config:
    """Engine knobs.

    model: path of a Hugging Face checkpoint directory (config.json, tokenizer, *.safetensors).
    max_num_seqs: most sequences in one batch (running and prefilling together).
    max_num_batched_tokens: most tokens computed in one forward pass; longer prompts are prefilled in chunks.
    max_model_len: longest sequence (prompt + output) in tokens; None = the checkpoint's max_position_embeddings.
        Capped at the KV cache's capacity (num_kvcache_blocks * kvcache_block_size) so one sequence always fits.
    kvcache_block_size: tokens per paged KV-cache block (prefix caching shares whole blocks).
    gpu_memory_utilization: on CUDA, fraction of device memory the engine may use (weights + KV cache);
        on CPU, fraction of physical RAM the KV cache may use at most (capped at 25%).
    num_kvcache_blocks: explicit number of KV-cache blocks; None = size from memory as above.
    enforce_eager: always run the model eagerly; False = on CUDA with the Triton attention path, decode steps
        replay CUDA graphs captured at bucketed batch sizes (1, 2, 4, 8, 16, 32, ... up to max_num_seqs).
    prefill_cuda_graphs: with CUDA graphs on (not enforce_eager), prefill and mixed steps of up to
        max_num_batched_tokens tokens also replay graphs: every layer's work but the attention, captured piecewise at
        bucketed token counts (prefill_graphs.py; SGLang's piecewise CUDA graph). False runs those steps eagerly.
    prefill_cuda_graph_max_tokens: the largest step (in tokens) the prefill graphs are captured for (SGLang's
        --piecewise-cuda-graph-max-tokens); longer steps run eagerly. None = max_num_batched_tokens. Lower it to
        hold less memory in the graphs' pool (their activations at that many tokens: 0.34 GiB for Qwen3-0.6B at
        8192 tokens, 0.71 GiB at 16384, on an H200) and capture fewer graphs.
    dtype: weight and activation dtype; "auto" = float32 on CPU, the checkpoint's dtype (bf16 if fp32) on CUDA.
    kv_cache_dtype: the KV cache's dtype (SGLang's --kv-cache-dtype): "auto" = the model dtype; "fp8_e4m3" or
        "fp8_e5m2" store K and V in 8 bits with no scale (saturated at the type's largest value): half the
        cache's bytes of bf16 (twice the tokens fit) and of what attention reads, at the price of rounding K/V
        (rollout log-probs then differ more from the trainer's; measure it with --get-mismatch-metrics). On an
        H200 (benchmarks/RESULTS.md, the attention reading fp8 in fp16 tiles): W1 (0.6B) +4-12%, W5 (135M)
        +19-22% output tok/s; in the colocated GRPO smoke the train/rollout mismatch went 0.0074 -> 0.026.
    device: "cpu", "cuda" or "auto" (cuda when available).
    seed: seed of the engine's sampling RNG (requests without sampling_seed draw their seed from it).
    overlap_schedule: in steady decode, launch step N+1 (its input tokens read on the device from step N's
        samples) before waiting for step N's tokens, so the host's bookkeeping runs while the device computes.
        Same tokens as without it; a request that stops at step N has its step N+1 token dropped. None (default)
        = on for CUDA, off on the CPU (where the forward runs on the host thread and nothing can overlap). On an
        H200 it turned 48% GPU idle time per decode step into 12% (benchmarks/RESULTS.md).
    overlap_prefill: with overlap_schedule, also launch the step after a prefill chunk (or while requests wait)
        before that chunk's tokens reach the host, its decode rows reading their input tokens on the device, so
        the host builds and launches the next chunk while the device computes this one. Same tokens as without
        it. On an H200 a prefill step of 8192 tokens of Qwen3-0.6B kept the device busy 44% of its wall time
        without it (the host's launch of the eager forward is longer than the device's compute).
    enable_return_routed_experts: record the experts every MoE layer routes each token to (int32, one row per KV
        cache slot, ~num_moe_layers * top_k * 4 bytes per token), so /generate can answer return_routed_experts
        (SGLang's server flag of the same name). MoE checkpoints only.
    tp_size: ranks of this engine (SGLang's --tp-size): attention heads, MLPs, the vocabulary and the KV cache are
        sharded over them (engine/parallel/). Rank 0 runs the scheduler and serves; ranks 1..tp_size-1 are child
        processes that follow rank 0's per-step plan. On CUDA each rank takes one visible device (cuda:0..N-1), over
        NCCL; on the CPU the ranks talk over gloo.
    ep_size: expert parallelism inside the tp_size ranks (SGLang's --ep-size, must divide tp_size): MoE experts split
        into ep_size contiguous blocks, each sharded by its intermediate dimension over tp_size // ep_size ranks.
    dist_timeout_s: how long a rank waits in a collective before it gives up (a dead or hung rank then takes the
        whole engine down instead of leaving it stuck).
    enable_lora: serve LoRA adapters unmerged (SGLang's --enable-lora; engine/lora/): adapters are loaded at run
        time (/load_lora_adapter, /load_lora_adapter_from_tensors) and a request picks one with `lora_path`. The
        buffers of max_loras_per_batch slots at max_lora_rank are allocated at start-up on q/k/v/o/gate/up/down of
        every layer. Decode steps replay CUDA graphs (LoRA's dense path, static shapes); prefill and mixed steps run
        eagerly (their tokens are grouped by adapter with host-side shapes). At tp_size > 1 every rank holds its
        shard of each adapter (engine/lora/targets.py).
    max_lora_rank: the largest adapter rank the slots hold (SGLang's --max-lora-rank); larger adapters are refused.
    max_loras_per_batch: adapter slots (SGLang's --max-loras-per-batch): how many adapters can be loaded at once,
        all of them usable in one step. An unloaded adapter's slot is reused once its running requests finish.
    true_on_policy: run every sequence through the batch-invariant decoder that the trainer also runs (slime:
        --true-on-policy-mode; engine/true_on_policy/), so the log-probs it reports equal the trainer's bit for bit.
        One sequence at a time, no CUDA graphs, no overlap; models and layouts it does not cover are refused.
    """

    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kvcache_block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kvcache_blocks: int | None = None
    enforce_eager: bool = False
    prefill_cuda_graphs: bool = True
    prefill_cuda_graph_max_tokens: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    overlap_schedule: bool | None = None
    overlap_prefill: bool = True
    enable_return_routed_experts: bool = False
    tp_size: int = 1
    ep_size: int = 1
    dist_timeout_s: float = 60.0
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras_per_batch: int = 8
    true_on_policy: bool = False

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty checkpoint path, got {self.model!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tp_size", "ep_size",
                     "max_lora_rank", "max_loras_per_batch"):
            _require_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kvcache_blocks", "prefill_cuda_graph_max_tokens"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enforce_eager", "prefill_cuda_graphs", "overlap_prefill", "enable_return_routed_experts",
                     "enable_lora", "true_on_policy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise ValueError(f"overlap_schedule must be a bool or None (on for CUDA), got {self.overlap_schedule!r}")
        if self.true_on_policy:
            self._check_true_on_policy()
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size} (--ep-size, --tp-size)")
        if not isinstance(self.dist_timeout_s, (int, float)) or self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be a positive number of seconds, got {self.dist_timeout_s!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def _check_true_on_policy(self) -> None:
        """The engine layouts true_on_policy covers (the model is checked when loaded: true_on_policy/contract.py)."""
        refused = [(self.tp_size > 1, f"tp_size {self.tp_size} (--tp-size; slime: --rollout-num-gpus-per-engine): a "
                    "sharded engine reduces over ranks in another order than the trainer; use one device per engine"),
                   (self.overlap_schedule is True, "overlap_schedule: the mode runs one step at a time; leave it "
                    "unset"),
                   (self.kv_cache_dtype != "auto", f"kv_cache_dtype {self.kv_cache_dtype!r}: the trainer keeps K/V in "
                    "the model dtype; use auto")]
        for is_refused, why in refused:
            if is_refused:
                raise ValueError(f"true_on_policy (slime: --true-on-policy-mode) does not cover {why}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> Config:
        """Build from keyword overrides, naming any key that is not a Config field."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown engine config field(s) {unknown}; valid fields: {cls.field_names()}")
        return cls(model=model, **kwargs)


def _require_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
