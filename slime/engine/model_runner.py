"""Runs one scheduled batch through the model: builds the flat token batch (input ids, positions, slot_mapping,
padded block tables, attention mask) as tensors, runs the forward pass, and samples one token for every sequence
whose chunk reaches its end.

Owns the model, its KV-cache tensors (allocation, freeing, re-allocation) and the weights' device storage (release
to / restore from a CPU copy). It does not schedule, check stop conditions or detokenize.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from slime.engine.config import Config
from slime.engine.cuda_graph import DecodeGraphs
from slime.engine.decode_rows import DecodeRows, sampling_values
from slime.engine.host_staging import HostStaging
from slime.engine.kernel_checks import grouped_mm_works, triton_attention_works, triton_fused_kernels_work
from slime.engine.layers.attention import AttentionMetadata
from slime.engine.models import DecoderForCausalLM, ModelConfig
from slime.engine.models.weight_loader import load_checkpoint
from slime.engine.sampler import SamplingBatch, sample
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduler import ScheduledSequence
from slime.engine.sequence import Sequence

CPU_KV_CACHE_RAM_FRACTION = 0.25


@dataclass
class LaunchedStep:
    """A step queued on the device. `tokens` [n] stays on the device (overlapped scheduling feeds the next step's
    inputs from it); `results` [2, n] float64 (token ids, log-probs) is the host copy, queued right behind the
    sampler, and `ready` the event that marks it complete (None on the CPU, where the copy is the result).

    The copy is queued at launch, not when the host asks for the results: queued later, it would sit behind the
    next step's kernels, and waiting for step N would mean waiting for step N+1 too."""

    tokens: torch.Tensor
    results: torch.Tensor
    ready: torch.cuda.Event | None


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
        self.staging = HostStaging(self.device)
        # Build in the target dtype (not .to(dtype) afterwards, which would also round the fp32 RoPE tables).
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = DecoderForCausalLM(model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.eval()
        if config.enable_return_routed_experts and not model_config.is_moe:
            raise ValueError(f"enable_return_routed_experts: {model_config.model_type} is not a mixture-of-experts "
                             "model")
        load_checkpoint(self.model, config.model)
        self.routed_experts: torch.Tensor | None = None
        # Released weights: their host copy (on CUDA, pinned buffers kept for the next release too).
        self.cpu_weights: dict[str, torch.Tensor] | None = None
        self.weights_released = False
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._num_blocks_from_memory()
        # One extra cache block past those the block manager hands out: CUDA-graph padding rows write there.
        self.scratch_slot = self.num_kvcache_blocks * self.block_size
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.max_num_blocks_per_seq = min(-(-max_model_len // self.block_size), self.num_kvcache_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        self.decode_rows = DecodeRows(model_config.vocab_size)
        attention_works = self.device.type == "cuda" and triton_attention_works(self.device)
        grouped_mm = grouped_mm_works(self.device, self.dtype) if model_config.is_moe else True
        for block in self.model.moe_blocks():
            block.experts.use_grouped_mm = grouped_mm
        # The per-expert fallback reads group sizes on the host, which a CUDA graph cannot capture.
        self.set_use_triton(attention_works, fused=attention_works and triton_fused_kernels_work(self.device),
                            cuda_graphs=grouped_mm)
        self.allocate_kv_cache()

    def set_use_triton(self, enabled: bool, fused: bool | None = None, cuda_graphs: bool = True) -> None:
        """Triton attention (and, unless enforce_eager or `cuda_graphs` is False, decode CUDA graphs) on or off,
        and the fused elementwise kernels (default: same as `enabled`); off = the pure-torch path. The runner turns
        each on only after its self-check passed on this machine."""
        self.use_triton = enabled
        self.use_cuda_graphs = enabled and cuda_graphs and not self.config.enforce_eager
        self.decode_graphs = None
        self.model.set_use_triton(enabled if fused is None else fused)

    # ---- memory -------------------------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        c = self.model_config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        kv_bytes = 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * element_size
        routing_bytes = len(c.moe_layers) * c.num_experts_per_tok * 4 * self.block_size
        return kv_bytes + (routing_bytes if self.config.enable_return_routed_experts else 0)

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

    def allocate_kv_cache(self) -> None:
        c = self.model_config
        shape = (self.num_kvcache_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim)
        for attn in self.model.attention_layers():
            # Zeros, not empty: masked-out slots enter SDPA multiplied by 0, and NaN garbage would survive that.
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.config.enable_return_routed_experts:
            # Indexed by cache slot like the K/V, so prefix-cache hits keep the routing of the tokens they skip.
            blocks = self.model.moe_blocks()
            self.routed_experts = torch.full((shape[0] * self.block_size, len(blocks), c.num_experts_per_tok), -1,
                                             dtype=torch.int32, device=self.device)
            for index, block in enumerate(blocks):
                block.routed_experts_cache = self.routed_experts[:, index]

    def free_kv_cache(self) -> None:
        self.decode_graphs = None  # they hold the cache's addresses
        self.decode_rows.clear()
        for attn in self.model.attention_layers():
            attn.k_cache = torch.empty(0, device=self.device)
            attn.v_cache = torch.empty(0, device=self.device)
        for block in self.model.moe_blocks():
            block.routed_experts_cache = None
        self.routed_experts = None
        self._empty_device_cache()

    def read_routed_experts(self, block_table: list[int], num_positions: int) -> np.ndarray:
        """The routing recorded for positions [0, num_positions) of a sequence holding `block_table`:
        [num_positions, num_moe_layers, top_k] int32 (one host sync)."""
        positions = np.arange(num_positions)
        slots = np.asarray(block_table, dtype=np.int64)[positions // self.block_size] * self.block_size
        slots += positions % self.block_size
        return self.routed_experts[self.staging.to_device(slots)].cpu().numpy()

    def release_weights(self) -> None:
        """Move parameter storage to a CPU copy and free the device storage (on CPU the copy is the storage).

        On CUDA the copy goes to pinned host buffers allocated at the first release and reused by every later one:
        pinning a model's worth of host memory took most of a release (0.7-1.1 s for 1.2 GB on an H200 host), the
        copy itself tens of milliseconds; a colocated RL run releases once per rollout."""
        if self.weights_released:
            return
        self.decode_graphs = None  # they hold the weights' addresses
        on_cuda = self.device.type == "cuda"
        if self.cpu_weights is None or not on_cuda:
            self.cpu_weights = {}
        for name, param in self.model.named_parameters():
            if not on_cuda:
                self.cpu_weights[name] = param.data
            else:
                buffer = self.cpu_weights.get(name)
                if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                    buffer = self.cpu_weights[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                buffer.copy_(param.data, non_blocking=True)
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        self.weights_released = True
        self._empty_device_cache()

    def resume_weights(self) -> None:
        if not self.weights_released:
            return
        for name, param in self.model.named_parameters():
            param.data = self.cpu_weights[name].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self.cpu_weights = None  # on the CPU they are the parameters' storage again
        self.weights_released = False

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def warm_up(self, num_tokens: int, num_decode_rows: int) -> None:
        """On CUDA, run what the first real batches would, on dummy sequences: a prefill chunk of `num_tokens`
        tokens that samples every sequence, then a decode step of `num_decode_rows` rows (which captures the CUDA
        graphs). Kernel compilation and lazy loading of GPU code then happen at start-up, not in a request's first
        steps (measured on an H200: the sampling kernel compiling inside a run's first prefill steps made them
        300-360 ms instead of ~30 ms). The dummies' K/V all go to the scratch cache block that no request owns; the
        block manager and prefix cache are not involved."""
        if self.device.type != "cuda":
            return
        params = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True)
        length = self.block_size
        seqs = [Sequence(f"warm-up-{i}", [0] * length, params, i) for i in range(max(1, num_tokens // length))]
        for seq in seqs:
            seq.block_table = [self.num_kvcache_blocks]  # the scratch block past those the block manager owns
        self.collect(self.launch([ScheduledSequence(seq, 0, length, True) for seq in seqs]))
        self.collect(self.launch([ScheduledSequence(seq, length - 1, 1, True) for seq in seqs[:num_decode_rows]]))

    # ---- one step -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSequence], input_tokens: torch.Tensor | None = None):
        """Queue the batch's forward, sampling and the copy of the results to the host without waiting: returns the
        LaunchedStep of the rows that sample, or None if none does. `input_tokens` ([len(scheduled)],
        on the device) replaces the input token of every row of a decode batch: tokens sampled by the previous
        step that the host has not seen yet (overlapped scheduling)."""
        positions = self._decode_graph_positions(scheduled)
        if positions is not None:  # every row samples; the rows' arrays come from self.decode_rows
            sample_rows = scheduled
            # Built first: its host-to-device copies would otherwise wait behind the forward pass.
            sampling = self._decode_sampling(positions)
            hidden = self._forward_decode_graph(scheduled, positions, input_tokens)
        else:
            self.decode_rows.clear()
            sample_rows = [row for row, item in enumerate(scheduled) if item.needs_sample]
            vocab_size = self.model_config.vocab_size
            sampled = [scheduled[row] for row in sample_rows]
            sampling = self.prepare_sampling(sampled, vocab_size) if sample_rows else None
            input_ids, positions, meta, logits_indices = self.prepare_inputs(scheduled)
            if input_tokens is not None:
                assert input_ids.shape == input_tokens.shape, "input_tokens needs a decode batch"
                input_ids = input_tokens
            hidden = self.model(input_ids, positions, meta)[logits_indices]
        if not sample_rows:
            return None
        tokens, log_probs = sample(self.model.compute_logits(hidden, upcast=False), sampling)
        results = torch.stack([tokens.double(), log_probs.double()])  # token ids are exact in float64
        if self.device.type != "cuda":
            return LaunchedStep(tokens, results, None)
        host = results.to("cpu", non_blocking=True)  # lands in pinned memory
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(tokens, host, ready)

    @staticmethod
    def collect(launched: LaunchedStep | None) -> tuple[list[int], list[float]]:
        """Wait for a launched step: its sampled token ids and log-probs as Python lists (the one host sync)."""
        if launched is None:
            return [], []
        if launched.ready is not None:
            launched.ready.synchronize()
        token_ids, token_log_probs = launched.results.tolist()
        return [int(token_id) for token_id in token_ids], token_log_probs

    @torch.inference_mode()
    def forward_logits(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Logits [num_new_tokens_total, vocab] of every computed token (for tests and log-prob scoring)."""
        input_ids, positions, meta, _ = self.prepare_inputs(scheduled)
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    def _decode_graph_positions(self, scheduled: list[ScheduledSequence]) -> np.ndarray | None:
        """For a decode batch that runs through a CUDA graph (one token per row, every row samples): each row's
        position, with self.decode_rows updated to its rows; None when the batch must run eagerly."""
        if not self.use_cuda_graphs or not scheduled or len(scheduled) > self.config.max_num_seqs:
            return None
        if any(item.num_new_tokens != 1 or not item.needs_sample for item in scheduled):
            return None
        if self.decode_graphs is None:
            self.decode_graphs = DecodeGraphs(
                self.model, self.config.max_num_seqs, self.max_num_blocks_per_seq, self.scratch_slot, self.staging
            )
        if len(scheduled) > self.decode_graphs.max_batch_size:
            return None
        self.decode_rows.update([item.seq for item in scheduled])
        if self.decode_rows.block_tables.shape[1] > self.max_num_blocks_per_seq:
            return None
        return np.fromiter(map(_start, scheduled), dtype=np.int64, count=len(scheduled))

    def _forward_decode_graph(self, scheduled: list[ScheduledSequence], positions: np.ndarray,
                              input_tokens: torch.Tensor | None) -> torch.Tensor:
        """Hidden states of a decode batch through a CUDA graph. With `input_tokens` (on the device) the host's
        token ids are not read: they are placeholders of tokens still on the device."""
        num_seqs = len(scheduled)
        block_tables = self.decode_rows.block_tables
        token_inputs = np.empty((4, num_seqs), dtype=np.int64)
        if input_tokens is None:
            token_inputs[0] = np.fromiter(
                (item.seq.token_ids[item.start] for item in scheduled), dtype=np.int64, count=num_seqs
            )
        else:
            token_inputs[0] = 0
        token_inputs[1] = positions
        token_inputs[2] = (
            block_tables[np.arange(num_seqs), positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        token_inputs[3] = positions + 1
        return self.decode_graphs.run(token_inputs, block_tables, input_tokens)

    def _decode_sampling(self, positions: np.ndarray) -> SamplingBatch:
        """prepare_sampling for a decode-graph batch, from the rows' cached sampling values."""
        rows = self.decode_rows
        steps = positions + 1 - rows.num_prompt_tokens  # tokens generated so far, the one being computed included
        banned_rows, banned_token_ids = [], []
        if (steps < rows.min_new_tokens).any():
            banned_rows, banned_token_ids = self._banned_stop_tokens(
                list(zip(range(len(rows.seqs)), [seq.sampling_params for seq in rows.seqs], steps.tolist()))
            )
        temperatures = rows.float_params[0]
        return self._sampling_batch(
            rows.float_params, rows.top_ks, rows.seeds, steps, banned_rows, banned_token_ids,
            needs_filtering=bool(rows.needs_filtering.any()),
            all_greedy=not temperatures.any(),
            any_greedy=not temperatures.all(),
        )

    def prepare_inputs(self, scheduled: list[ScheduledSequence]):
        """(input_ids, positions, AttentionMetadata, logits_indices) on the device; the metadata is filled for the
        Triton path or the torch path."""
        num_seqs = len(scheduled)
        starts = np.fromiter((item.start for item in scheduled), dtype=np.int64, count=num_seqs)
        query_lens = np.fromiter((item.num_new_tokens for item in scheduled), dtype=np.int64, count=num_seqs)
        input_ids = []
        for item in scheduled:
            input_ids.extend(item.seq.token_ids[item.start : item.start + item.num_new_tokens])
        block_tables = _padded_block_tables([item.seq.block_table for item in scheduled])
        num_tokens = len(input_ids)
        cu_seqlens = np.cumsum(query_lens)
        token_seq_index = np.repeat(np.arange(num_seqs), query_lens)
        token_query_index = np.arange(num_tokens) - (cu_seqlens - query_lens)[token_seq_index]
        positions = starts[token_seq_index] + token_query_index
        slot_mapping = (
            block_tables[token_seq_index, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        logits_indices = (cu_seqlens - 1)[[i for i, item in enumerate(scheduled) if item.needs_sample]]
        max_query_len = int(query_lens.max())
        to_device = self.staging.to_device
        input_ids_t, positions_t, slot_mapping_t, logits_indices_t = self.staging.to_device_packed(
            [np.asarray(input_ids, dtype=np.int64), positions, slot_mapping, logits_indices], np.int64
        )
        if self.use_triton:
            query_start_loc, seq_lens, flat_tables = self.staging.to_device_packed(
                [np.concatenate([[0], cu_seqlens]), starts + query_lens, block_tables.ravel()], np.int32
            )
            meta = AttentionMetadata(
                slot_mapping=slot_mapping_t,
                block_tables=flat_tables.view(block_tables.shape),
                max_query_len=max_query_len,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
            )
            return input_ids_t, positions_t, meta, logits_indices_t
        query_positions = starts[:, None] + np.arange(max_query_len)[None, :]
        query_positions = np.where(np.arange(max_query_len)[None, :] < query_lens[:, None], query_positions, 0)
        key_positions = np.arange(block_tables.shape[1] * self.block_size)
        attn_mask = (key_positions[None, None, :] <= query_positions[:, :, None])[:, None]
        key_slots = (block_tables.astype(np.int64)[:, :, None] * self.block_size + np.arange(self.block_size))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping_t,
            block_tables=to_device(block_tables.astype(np.int64)),
            max_query_len=max_query_len,
            key_slots=to_device(key_slots.reshape(num_seqs, -1)),
            token_seq_index=to_device(token_seq_index),
            token_query_index=to_device(token_query_index),
            attn_mask=to_device(attn_mask),
        )
        return input_ids_t, positions_t, meta, logits_indices_t

    def prepare_sampling(self, sampled: list[ScheduledSequence], vocab_size: int) -> SamplingBatch:
        """Per-row sampling tensors, sent in two host-to-device copies (int64 and float32 rows). Each distinct
        SamplingParams object is read once per step (a batch usually shares one)."""
        num_rows = len(sampled)
        seqs = [item.seq for item in sampled]
        params_of_rows = [seq.sampling_params for seq in seqs]
        distinct = {id(params): params for params in params_of_rows}
        values = {key: sampling_values(params, vocab_size) for key, params in distinct.items()}
        if len(values) == 1:
            (only,) = values.values()
            float_columns = np.broadcast_to(np.array(only[:3], dtype=np.float32)[:, None], (3, num_rows))
            top_ks = np.full(num_rows, only[3], dtype=np.int64)
        else:
            rows = [values[id(params)] for params in params_of_rows]
            float_columns = np.array([row[:3] for row in rows], dtype=np.float32).T
            top_ks = np.fromiter((row[3] for row in rows), dtype=np.int64, count=num_rows)
        seeds = np.fromiter((seq.seed for seq in seqs), dtype=np.int64, count=num_rows)
        steps = np.fromiter(
            (len(seq.token_ids) - seq.num_prompt_tokens for seq in seqs), dtype=np.int64, count=num_rows
        )
        banned_rows, banned_token_ids = [], []
        if any(params.min_new_tokens > 0 for params in distinct.values()):
            banned_rows, banned_token_ids = self._banned_stop_tokens(
                list(zip(range(num_rows), params_of_rows, steps.tolist()))
            )
        return self._sampling_batch(
            float_columns, top_ks, seeds, steps, banned_rows, banned_token_ids,
            needs_filtering=any(value[4] for value in values.values()),
            all_greedy=not any(value[0] for value in values.values()),
            any_greedy=any(value[0] == 0 for value in values.values()),
        )

    def _banned_stop_tokens(self, rows) -> tuple[list[int], list[int]]:
        """(row, token) pairs masked out of sampling: the stop tokens of each (row, params, step) whose step is
        still under its min_new_tokens."""
        vocab_size = self.model_config.vocab_size
        banned_rows, banned_token_ids = [], []
        for row, params, step in rows:
            if step < params.min_new_tokens:
                stop_ids = set(params.stop_token_ids)
                if not params.ignore_eos:
                    stop_ids |= self.eos_token_ids
                for token_id in sorted(t for t in stop_ids if t < vocab_size):
                    banned_rows.append(row)
                    banned_token_ids.append(token_id)
        return banned_rows, banned_token_ids

    def _sampling_batch(self, float_columns, top_ks, seeds, steps, banned_rows, banned_token_ids,
                        **flags) -> SamplingBatch:
        int_tensors = self.staging.to_device_packed(
            [top_ks, seeds, steps, np.array(banned_rows, dtype=np.int64), np.array(banned_token_ids, dtype=np.int64)],
            np.int64,
        )
        temperatures, top_ps, min_ps = self.staging.to_device_packed(list(float_columns), np.float32)
        return SamplingBatch(
            temperatures=temperatures,
            top_ks=int_tensors[0],
            top_ps=top_ps,
            min_ps=min_ps,
            seeds=int_tensors[1],
            steps=int_tensors[2],
            banned_rows=int_tensors[3],
            banned_token_ids=int_tensors[4],
            **flags,
        )


_start = attrgetter("start")


def _padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """[num_seqs, longest table] int32, padded with block 0 (never read: masked by context lengths)."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.zeros((len(tables), int(lengths.max())), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]] = flat  # row-major, as the chain
    return padded
