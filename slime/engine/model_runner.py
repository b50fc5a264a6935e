"""Runs one scheduled batch through the model: builds the flat token batch (input ids, positions, slot_mapping,
padded block tables, attention mask) as tensors, runs the forward pass, and samples one token for every sequence
whose chunk reaches its end.

Owns the model, its KV-cache tensors (allocation, freeing, re-allocation) and the weights' device storage (release
to / restore from a host copy, host_weights.py). It does not schedule, check stop conditions or detokenize.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from slime.engine.config import Config
from slime.engine.cuda_graph import DecodeGraphs, ParkedGraphs, bucket_batch_sizes
from slime.engine.decode_rows import DecodeRows
from slime.engine.dtypes import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from slime.engine.host_staging import HostStaging
from slime.engine.host_weights import HostWeights
from slime.engine.kernel_checks import (
    grouped_mm_works,
    triton_attention_works,
    triton_fused_kernels_work,
    triton_mla_attention_works,
)
from slime.engine.kv_cache import KVCacheStorage, num_blocks_from_memory
from slime.engine.layers.attention import AttentionMetadata
from slime.engine.models import DecoderForCausalLM, ModelConfig
from slime.engine.models.vl_model import VLForConditionalGeneration
from slime.engine.models.weight_loader import load_checkpoint
from slime.engine.parallel.every_rank import every_rank
from slime.engine.parallel.state import SINGLE, ParallelState
from slime.engine.parallel.step_plan import DecodeGraphInputs, encode_decode_graph, encode_forward
from slime.engine.prefill_graphs import PrefillGraphs
from slime.engine.runner_memory import RunnerMemory
from slime.engine.sampler import sample_results
from slime.engine.sampling_inputs import DecodeSampling, prepare_sampling
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import DecodeBatch, ScheduledSequence, is_decode_batch, sampled_seqs
from slime.engine.sequence import Sequence
from slime.engine.step_inputs import flat_arrays, flat_batch
from slime.engine.vl_step import decode_rope_deltas, vision_step_inputs


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


class ModelRunner(RunnerMemory):
    def __init__(self, config: Config, model_config: ModelConfig, eos_token_ids: set[int],
                 parallel: ParallelState = SINGLE):
        """`parallel`: this rank's place in a sharded engine; the model, and the KV cache, are then its shard."""
        self.config = config
        self.parallel = parallel
        # A sharded engine's rank 0: the EngineRanks that every step's plan and every @every_rank call go to first.
        self.plan = None
        self.eos_token_ids = set(eos_token_ids)
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.kvcache_block_size
        self.staging = HostStaging(self.device)
        # Build in the target dtype (not .to(dtype) afterwards, which would also round the fp32 RoPE tables).
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model_class = VLForConditionalGeneration if model_config.is_vision_language else DecoderForCausalLM
                self.model = model_class(model_config, parallel)
        except torch.OutOfMemoryError as error:
            raise ValueError(f"the model's weights do not fit this device at tp_size {parallel.tp_size}: spread "
                             "them over more devices (--tp-size; slime: --rollout-num-gpus-per-engine), or leave "
                             "more memory to the engine (slime: --sglang-mem-fraction-static, offloading the "
                             f"trainer): {error}") from None
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.eval()
        if config.enable_return_routed_experts and not model_config.is_moe:
            raise ValueError(f"enable_return_routed_experts: {model_config.model_type} is not a mixture-of-experts "
                             "model")
        self.host_weights = HostWeights(self.device)
        self.host_weights.place(self.model)
        load_checkpoint(self.model, config.model)
        self.routed_experts: torch.Tensor | None = None
        self.lora, self.lora_registry = self._lora_slots()  # before the KV cache is sized from what memory is left
        # The KV pool is sized from the rank with the least free memory.
        self.num_kvcache_blocks = parallel.min_over_ranks(config.num_kvcache_blocks or num_blocks_from_memory(
            config, model_config, self.device, self.bytes_per_block), self.device)
        # One extra cache block past those the block manager hands out: CUDA-graph padding rows write there.
        self.scratch_slot = self.num_kvcache_blocks * self.block_size
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.max_num_blocks_per_seq = min(-(-max_model_len // self.block_size), self.num_kvcache_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # while a release that keeps the graphs' memory has freed what they read: decode's, prefill's
        self.parked_graphs, self.parked_prefill_graphs = ParkedGraphs(), ParkedGraphs("prefill")
        self.captured_decode_graphs = False  # the first DecodeGraphs captures every bucket; later ones lazily
        self.captured_prefill_graphs = False  # likewise the first PrefillGraphs
        self.warmed_prefill_sizes: set[int] = set()
        self.graph_capture_stats = {"graphs": 0, "seconds": 0.0}  # every capture since start-up (engine loop logs it)
        self.warmed_decode_batch_sizes: set[int] = set()  # captured once: a capture again needs no warm-up
        self.decode_rows = DecodeRows(model_config.vocab_size, self.block_size)
        self.decode_sampling = DecodeSampling(self.staging, self.eos_token_ids)
        self.kv_storage: KVCacheStorage | None = None
        self.kv_cache: torch.Tensor | None = None  # every layer's K and V; uninitialized on the Triton path
        self.kv_cache_zeroed = False
        if model_config.mla is not None:  # the latent cache has its own kernel
            mla = model_config.mla
            attention_works = self.device.type == "cuda" and triton_mla_attention_works(
                self.device, self.dtype, model_config.num_attention_heads, mla.kv_lora_rank, mla.qk_rope_head_dim)
        else:
            attention_works = self.device.type == "cuda" and triton_attention_works(self.device, self.kv_dtype)
        grouped_mm = grouped_mm_works(self.device, self.dtype) if model_config.is_moe else True
        for block in self.model.moe_blocks():
            block.experts.use_grouped_mm = grouped_mm
        # The per-expert fallback reads group sizes on the host, which a CUDA graph cannot capture.
        self.set_use_triton(attention_works,
                            fused=attention_works and triton_fused_kernels_work(self.device, self.kv_dtype),
                            cuda_graphs=grouped_mm)
        self.true_on_policy = self._true_on_policy_forward()
        self.allocate_kv_cache()

    def _true_on_policy_forward(self):
        """With config.true_on_policy, the batch-invariant forward every step runs through (refusing a model it does
        not cover); else None."""
        if not self.config.true_on_policy:
            return None
        from slime.engine.true_on_policy.contract import decoder_spec, pin_cpu_threads
        from slime.engine.true_on_policy.engine_path import TrueOnPolicyForward

        spec = decoder_spec(self.model_config)
        pin_cpu_threads(self.device)
        self.use_cuda_graphs = False
        return TrueOnPolicyForward(self.model, spec, self.block_size)

    def drop_sequence(self, rid: str) -> None:
        """A finished sequence's per-sequence state (true_on_policy) is freed."""
        if self.true_on_policy is not None:
            self.true_on_policy.drop(rid)

    def forget_computed_tokens(self) -> None:
        """After a cache flush (every weight update flushes): true_on_policy recomputes each sequence's prefix."""
        if self.true_on_policy is not None:
            self.true_on_policy.weights_changed()

    def _lora_slots(self):
        """(LoraSlots, LoraRegistry) with enable_lora, else (None, None)."""
        if not self.config.enable_lora:
            return None, None
        from slime.engine.lora.slots import build_lora_slots

        return build_lora_slots(self.model, self.config, self.device, bucket_batch_sizes(self.config.max_num_seqs)[-1])

    @every_rank
    def write_lora_slot(self, slot: int, adapter) -> None:
        """Put a LoRA adapter (full tensors, engine/lora/adapter.py) into `slot`, each rank its own part of it."""
        self.lora.write(slot, adapter)
        if self.true_on_policy is not None:  # the batch-invariant path computes from the adapter's own tensors
            self.true_on_policy.set_adapter(slot, adapter)

    @every_rank
    def set_use_triton(self, enabled: bool, fused: bool | None = None, cuda_graphs: bool = True) -> None:
        """Triton attention (and, unless enforce_eager or `cuda_graphs` is False, decode CUDA graphs) on or off,
        and the fused elementwise kernels (default: same as `enabled`); off = the pure-torch path. The runner turns
        each on only after its self-check passed on this machine."""
        self.use_triton = enabled
        if not enabled and self.kv_cache is not None and not self.kv_cache_zeroed:
            self.kv_cache.zero_()  # the pure-torch path reads masked slots (allocate_kv_cache)
            self.kv_cache_zeroed = True
        self.use_cuda_graphs = enabled and cuda_graphs and not self.config.enforce_eager
        self.decode_graphs = self.prefill_graphs = None
        self.clear_parked_graphs()
        self.model.set_use_triton(enabled if fused is None else fused)

    def warm_up(self, num_tokens: int, num_decode_rows: int) -> None:
        """On CUDA, run what the first real batches would, on dummy sequences: a prefill chunk of `num_tokens`
        tokens that samples every sequence, then a decode step of `num_decode_rows` rows (which captures the CUDA
        graphs). Kernel compilation and lazy loading of GPU code then happen at start-up, not in a request's first
        steps (measured on an H200: the sampling kernel compiling inside a run's first prefill steps made them
        300-360 ms instead of ~30 ms). The dummies' K/V all go to the scratch cache block that no request owns; the
        block manager and prefix cache are not involved."""
        if self.device.type != "cuda" or self.true_on_policy is not None:
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
    def launch(self, scheduled: list[ScheduledSequence] | DecodeBatch, input_tokens: torch.Tensor | None = None,
               input_rows: np.ndarray | None = None):
        """Queue the batch's forward, sampling and the copy of the results to the host without waiting: returns the
        LaunchedStep of the rows that sample, or None if none does. `input_tokens` (on the device) are tokens
        sampled by the previous step that the host has not seen yet (overlapped scheduling): the input token of
        every row of a decode batch ([len(scheduled)]), or with `input_rows` that of those rows only, each a
        one-token row (the others read theirs from the host)."""
        if self.true_on_policy is not None:
            return self._launch_true_on_policy(list(scheduled))
        positions = self._decode_graph_positions(scheduled)
        if positions is not None:  # every row samples; the rows' arrays come from self.decode_rows
            sample_rows = scheduled
            # Built first: its host-to-device copies would otherwise wait behind the forward pass.
            sampling = self.decode_sampling.build(self.decode_rows, positions)
            hidden = self._forward_decode_graph(scheduled, positions, input_tokens, input_rows)
        else:
            self.decode_rows.clear()
            sample_rows = [row for row, item in enumerate(scheduled) if item.needs_sample]
            vocab_size = self.model_config.vocab_size
            sampled = [scheduled[row] for row in sample_rows]
            sampling = prepare_sampling(sampled, vocab_size, self.staging, self.eos_token_ids) if sample_rows else None
            input_ids, positions, meta, logits_indices = self.prepare_inputs(scheduled)
            vision = self._vision_inputs(scheduled)
            if vision is not None:
                positions = vision[0]
            if input_tokens is not None and input_rows is not None:  # row i's one token is at its end offset
                ends = np.cumsum(np.fromiter(map(_num_new_tokens, scheduled), dtype=np.int64, count=len(scheduled)))
                input_ids[self.staging.to_device(ends[input_rows] - 1)] = input_tokens
            elif input_tokens is not None:
                assert input_ids.shape == input_tokens.shape, "input_tokens needs a decode batch"
                input_ids = input_tokens
            hidden = self._forward(input_ids, positions, meta, vision)[logits_indices]
        if not sample_rows:
            return None
        tokens, results = sample_results(self.model.compute_logits(hidden, upcast=False), sampling)
        if self.device.type != "cuda":
            return LaunchedStep(tokens, results, None)
        host = results.to("cpu", non_blocking=True)  # lands in pinned memory
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(tokens, host, ready)

    def _launch_true_on_policy(self, scheduled: list[ScheduledSequence]) -> LaunchedStep | None:
        """The step through the batch-invariant decoder, sequence by sequence (true_on_policy/engine_path.py): the
        draw from its logits, the reported log-probs from the shared log_softmax of each token's tile."""
        from slime.engine.true_on_policy.engine_path import token_log_probs

        sample_rows, logits, tiles, tile_rows = self.true_on_policy.step(scheduled)
        if not sample_rows:
            return None
        sampled = [scheduled[row] for row in sample_rows]
        sampling = prepare_sampling(sampled, self.model_config.vocab_size, self.staging, self.eos_token_ids)
        tokens, results = sample_results(logits, sampling)
        results[1] = token_log_probs(tiles, tile_rows, tokens,
                                     [item.seq.sampling_params.temperature for item in sampled]).to(results.device)
        return LaunchedStep(tokens, results.cpu(), None)

    def _vision_inputs(self, scheduled):
        """A VL model's (positions, image embeddings, deepstack) of a flat batch (vl_step.py); None for a text model."""
        if not self.model_config.is_vision_language:
            return None
        return vision_step_inputs(self.model, scheduled, self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 vision=None) -> torch.Tensor:
        """A step's forward outside the decode graphs: through the piecewise prefill graphs where they apply (not
        for a VL step that has 3-D positions or image rows: it runs eagerly)."""
        if vision is not None and (positions.dim() == 2 or vision[1] is not None):
            return self.model(input_ids, positions, meta, image_embeds=vision[1], deepstack=vision[2])
        # The piecewise graphs split the q/k/v decoder's attention stages; MLA's run eagerly (decode graphs apply).
        # LoRA's segmented path has host-side shapes: its prefill steps run eagerly too.
        piecewise = (self.config.prefill_cuda_graphs and self.model_config.mla is None and self.lora is None
                     and not self.model_config.is_vision_language)
        if not (self.use_cuda_graphs and piecewise and meta.uses_triton):
            return self.model(input_ids, positions, meta)
        if self.prefill_graphs is None:
            max_tokens = min(self.config.prefill_cuda_graph_max_tokens or self.config.max_num_batched_tokens,
                             self.config.max_num_batched_tokens)
            self.prefill_graphs = PrefillGraphs(
                self.model, max_tokens, self.scratch_slot,
                capture_all=not self.captured_prefill_graphs, capture_stats=self.graph_capture_stats,
                warmed_sizes=self.warmed_prefill_sizes)
            self.captured_prefill_graphs = True
        if not self.prefill_graphs.fits(input_ids.shape[0]):
            return self.model(input_ids, positions, meta)
        return self.prefill_graphs.run(input_ids, positions, meta)

    @staticmethod
    def collect(launched: LaunchedStep | None) -> tuple[list[int], list[float]]:
        """Wait for a launched step: its sampled token ids and log-probs as Python lists (the one host sync)."""
        if launched is None:
            return [], []
        if launched.ready is not None:
            launched.ready.synchronize()
        results = launched.results.numpy()
        return results[0].astype(np.int64).tolist(), results[1].tolist()

    @torch.inference_mode()
    def forward_logits(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Logits [num_new_tokens_total, vocab] of every computed token (for tests and log-prob scoring)."""
        input_ids, positions, meta, _ = self.prepare_inputs(scheduled, all_logits=True)
        vision = self._vision_inputs(scheduled)
        if vision is not None:
            return self.model.compute_logits(self.model(input_ids, vision[0], meta, image_embeds=vision[1],
                                                        deepstack=vision[2]))
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    def _decode_graph_positions(self, scheduled: list[ScheduledSequence] | DecodeBatch) -> np.ndarray | None:
        """For a decode batch that runs through a CUDA graph (one token per row, every row samples): each row's
        position, with self.decode_rows updated to its rows; None when the batch must run eagerly."""
        if not self.use_cuda_graphs or not scheduled or len(scheduled) > self.config.max_num_seqs:
            return None
        if not is_decode_batch(scheduled):
            return None
        if self.decode_graphs is None:
            self._ensure_decode_graphs()
        if len(scheduled) > self.decode_graphs.max_batch_size:
            return None
        if isinstance(scheduled, DecodeBatch):
            positions = np.array(scheduled.starts, dtype=np.int64)
        else:
            positions = np.fromiter(map(_start, scheduled), dtype=np.int64, count=len(scheduled))
        self.decode_rows.update(sampled_seqs(scheduled), positions)
        if self.decode_rows.block_tables.shape[1] > self.max_num_blocks_per_seq:
            return None
        return positions

    @every_rank
    def _ensure_decode_graphs(self) -> None:
        """The decode graphs, captured now if there are none (on every rank at once: a capture runs the model)."""
        if self.decode_graphs is None:
            if self.lora is not None:  # captured on LoRA's dense path, every row without an adapter
                self.lora.set_graph_rows(np.empty(0, dtype=np.int64))
            self.decode_graphs = DecodeGraphs(
                self.model, self.config.max_num_seqs, self.max_num_blocks_per_seq, self.scratch_slot, self.staging,
                capture_all=not self.captured_decode_graphs, capture_stats=self.graph_capture_stats,
                warmed_batch_sizes=self.warmed_decode_batch_sizes,
            )
            self.captured_decode_graphs = True

    def _forward_decode_graph(self, scheduled: list[ScheduledSequence] | DecodeBatch, positions: np.ndarray,
                              input_tokens: torch.Tensor | None, input_rows: np.ndarray | None) -> torch.Tensor:
        """Hidden states of a decode batch through a CUDA graph. With `input_tokens` (on the device) the host's
        token ids of every row, or of `input_rows`, are not read: they are placeholders of tokens still on the
        device."""
        num_seqs = len(scheduled)
        block_tables = self.decode_rows.block_tables
        token_inputs = np.empty((4, num_seqs), dtype=np.int64)
        if input_tokens is None or input_rows is not None:
            token_inputs[0] = np.fromiter(
                map(_token_at, self.decode_rows.seqs, positions.tolist()), dtype=np.int64, count=num_seqs
            )
        else:
            token_inputs[0] = 0
        token_inputs[1] = positions
        if self.model_config.is_vision_language:  # M-RoPE past the prompt: plain RoPE at position + rope_delta
            token_inputs[1] += decode_rope_deltas(self.decode_rows.seqs)
        token_inputs[2] = (
            block_tables[np.arange(num_seqs), positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        token_inputs[3] = positions + 1
        lora_slots = np.fromiter((seq.lora_slot for seq in self.decode_rows.seqs), dtype=np.int64, count=num_seqs)
        if self.plan is not None:  # a sharded engine runs without overlap: input_tokens is None here
            self.plan.send_step(encode_decode_graph(DecodeGraphInputs(token_inputs, block_tables, lora_slots)))
        if self.lora is not None:  # each row's adapter slot, into the graphs' static one-hot buffer
            self.lora.set_graph_rows(lora_slots)
        if input_rows is not None:
            return self.decode_graphs.run(token_inputs, block_tables, input_tokens, self.staging.to_device(input_rows))
        return self.decode_graphs.run(token_inputs, block_tables, input_tokens)

    def prepare_inputs(self, scheduled: list[ScheduledSequence], all_logits: bool = False):
        """(input_ids, positions, AttentionMetadata, logits_indices) on the device (step_inputs.py). In a sharded
        engine the step's host arrays first go to the other ranks, which build the same tensors (`follow_step`)."""
        arrays = flat_arrays(scheduled)
        if self.lora is not None:  # each token's adapter slot, in flat-batch order
            self.lora.set_batch(np.repeat(arrays.lora_slots, arrays.query_lens))
        if self.plan is not None:
            self.plan.send_step(encode_forward(arrays, all_logits))
        return flat_batch(arrays, self.block_size, self.staging, self.use_triton)

    @torch.inference_mode()
    def follow_step(self, message) -> None:
        """Ranks 1..N-1 of a sharded engine: run what rank 0 runs for one step of its plan (step_plan.py), so every
        collective inside the model pairs up; the logits are gathered on every rank but sampled on rank 0 only."""
        op, all_logits, payload = message
        if isinstance(payload, DecodeGraphInputs):
            self._ensure_decode_graphs()
            if self.lora is not None:
                self.lora.set_graph_rows(payload.lora_slots)
            self.model.compute_logits(self.decode_graphs.run(payload.token_inputs, payload.block_tables, None),
                                      upcast=False)
            return
        if self.lora is not None:
            self.lora.set_batch(np.repeat(payload.lora_slots, payload.query_lens))
        input_ids, positions, meta, logits_indices = flat_batch(payload, self.block_size, self.staging,
                                                                self.use_triton)
        if all_logits:
            self.model.compute_logits(self.model(input_ids, positions, meta))
        elif len(logits_indices):
            self.model.compute_logits(self._forward(input_ids, positions, meta)[logits_indices], upcast=False)
        else:
            self._forward(input_ids, positions, meta)


_start, _num_new_tokens = attrgetter("start"), attrgetter("num_new_tokens")


def _token_at(seq: Sequence, position: int) -> int:
    return seq.token_ids[position]
