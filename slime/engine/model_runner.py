"""Runs one scheduled batch through the model: builds the flat token batch (input ids, positions, slot_mapping,
padded block tables, attention mask) as tensors, runs the forward pass, and samples one token for every sequence
whose chunk reaches its end.

Owns the model, its KV-cache tensors (allocation, freeing, re-allocation) and the weights' device storage (release
to / restore from a CPU copy). It does not schedule, check stop conditions or detokenize.
"""

from __future__ import annotations

import os

import torch

from slime.engine.config import Config
from slime.engine.layers.attention import AttentionMetadata
from slime.engine.models import DecoderForCausalLM, ModelConfig
from slime.engine.models.weight_loader import load_checkpoint
from slime.engine.sampler import SamplingBatch, sample
from slime.engine.scheduler import ScheduledSequence

CPU_KV_CACHE_RAM_FRACTION = 0.25


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


class ModelRunner:
    def __init__(self, config: Config, model_config: ModelConfig, eos_token_ids: set[int]):
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        self.block_size = config.kvcache_block_size
        # Build in the target dtype (not .to(dtype) afterwards, which would also round the fp32 RoPE tables).
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = DecoderForCausalLM(model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.eval()
        load_checkpoint(self.model, config.model)
        self.cpu_weights: dict[str, torch.Tensor] | None = None
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._num_blocks_from_memory()
        self.allocate_kv_cache()

    # ---- memory -------------------------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        c = self.model_config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * element_size

    def _num_blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.config.gpu_memory_utilization - used
        else:
            total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            budget = total_ram * min(self.config.gpu_memory_utilization, CPU_KV_CACHE_RAM_FRACTION)
        max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        wanted = self.config.max_num_seqs * ((max_model_len + self.block_size - 1) // self.block_size)
        num_blocks = min(wanted, int(budget // self.bytes_per_block))
        if num_blocks < 1:
            raise ValueError(
                f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no memory for the KV cache; "
                "raise it or set num_kvcache_blocks"
            )
        return num_blocks

    @property
    def has_kv_cache(self) -> bool:
        return self.model.attention_layers()[0].k_cache.numel() > 0

    @property
    def has_weights(self) -> bool:
        return self.cpu_weights is None

    def allocate_kv_cache(self) -> None:
        c = self.model_config
        shape = (self.num_kvcache_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        for attn in self.model.attention_layers():
            # Zeros, not empty: masked-out slots enter SDPA multiplied by 0, and NaN garbage would survive that.
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def free_kv_cache(self) -> None:
        for attn in self.model.attention_layers():
            attn.k_cache = torch.empty(0, device=self.device)
            attn.v_cache = torch.empty(0, device=self.device)
        self._empty_device_cache()

    def release_weights(self) -> None:
        """Move parameter storage to a CPU copy and free the device storage (on CPU the copy is the storage)."""
        if self.cpu_weights is not None:
            return
        self.cpu_weights = {}
        for name, param in self.model.named_parameters():
            self.cpu_weights[name] = param.data.to("cpu", copy=self.device.type != "cpu")
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self._empty_device_cache()

    def resume_weights(self) -> None:
        if self.cpu_weights is None:
            return
        for name, param in self.model.named_parameters():
            param.data = self.cpu_weights[name].to(self.device)
        self.cpu_weights = None

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- one step -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence]) -> tuple[list[int], list[float]]:
        """Forward the batch; returns sampled token ids and log-probs for the sequences whose needs_sample is True,
        in schedule order."""
        input_ids, positions, meta, logits_indices = self.prepare_inputs(scheduled)
        hidden = self.model(input_ids, positions, meta)
        sampled = [item for item in scheduled if item.needs_sample]
        if not sampled:
            return [], []
        logits = self.model.compute_logits(hidden[logits_indices])
        tokens, log_probs = sample(logits, self.prepare_sampling(sampled, logits.shape[-1]))
        return tokens.tolist(), log_probs.tolist()

    @torch.inference_mode()
    def forward_logits(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Logits [num_new_tokens_total, vocab] of every computed token (for tests and log-prob scoring)."""
        input_ids, positions, meta, _ = self.prepare_inputs(scheduled)
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    def prepare_inputs(self, scheduled: list[ScheduledSequence]):
        starts, query_lens, input_ids, block_tables = [], [], [], []
        for item in scheduled:
            start = item.start
            starts.append(start)
            query_lens.append(item.num_new_tokens)
            input_ids.extend(item.seq.token_ids[start : start + item.num_new_tokens])
            block_tables.append(item.seq.block_table)
        device = self.device
        num_seqs = len(scheduled)
        max_query_len = max(query_lens)
        max_num_blocks = max(len(table) for table in block_tables)
        padded_tables = torch.tensor(
            [table + [0] * (max_num_blocks - len(table)) for table in block_tables], dtype=torch.int64
        )
        starts_t = torch.tensor(starts, dtype=torch.int64)
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        token_seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
        cu_seqlens = torch.cumsum(query_lens_t, 0)
        token_query_index = torch.arange(len(input_ids)) - (cu_seqlens - query_lens_t)[token_seq_index]
        positions = starts_t[token_seq_index] + token_query_index
        slot_mapping = (
            padded_tables[token_seq_index, positions // self.block_size] * self.block_size + positions % self.block_size
        )
        query_positions = starts_t[:, None] + torch.arange(max_query_len)[None, :]
        query_positions = torch.where(torch.arange(max_query_len)[None, :] < query_lens_t[:, None], query_positions, 0)
        key_positions = torch.arange(max_num_blocks * self.block_size)
        attn_mask = (key_positions[None, None, :] <= query_positions[:, :, None]).unsqueeze(1)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            block_tables=padded_tables.to(device, non_blocking=True),
            token_seq_index=token_seq_index.to(device, non_blocking=True),
            token_query_index=token_query_index.to(device, non_blocking=True),
            attn_mask=attn_mask.to(device, non_blocking=True),
        )
        logits_indices = (cu_seqlens - 1)[[i for i, item in enumerate(scheduled) if item.needs_sample]]
        return (
            torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
            positions.to(device, non_blocking=True),
            meta,
            logits_indices.to(device, non_blocking=True),
        )

    def prepare_sampling(self, sampled: list[ScheduledSequence], vocab_size: int) -> SamplingBatch:
        temperatures, top_ks, top_ps, min_ps, seeds, steps = [], [], [], [], [], []
        banned_rows, banned_token_ids = [], []
        needs_filtering = False
        for row, item in enumerate(sampled):
            seq, params = item.seq, item.seq.sampling_params
            temperatures.append(params.temperature)
            top_ks.append(vocab_size if params.top_k == -1 else params.top_k)
            top_ps.append(params.top_p if params.top_p < 1.0 else 2.0)  # 2.0: never cut by float round-off
            min_ps.append(params.min_p)
            needs_filtering |= params.top_k != -1 or params.top_p < 1.0 or params.min_p > 0.0
            seeds.append(seq.seed)
            steps.append(seq.num_completion_tokens)
            if seq.num_completion_tokens < params.min_new_tokens:
                stop_ids = set(params.stop_token_ids)
                if not params.ignore_eos:
                    stop_ids |= self.eos_token_ids
                for token_id in sorted(t for t in stop_ids if t < vocab_size):
                    banned_rows.append(row)
                    banned_token_ids.append(token_id)
        device = self.device
        return SamplingBatch(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            steps=torch.tensor(steps, dtype=torch.int64, device=device),
            banned_rows=torch.tensor(banned_rows, dtype=torch.int64, device=device),
            banned_token_ids=torch.tensor(banned_token_ids, dtype=torch.int64, device=device),
            needs_filtering=needs_filtering,
        )
