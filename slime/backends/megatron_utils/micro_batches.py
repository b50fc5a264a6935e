"""Packed micro-batches through megatron-core's pipeline schedules (`get_forward_backward_func`): forward-only
passes for log-probs / entropy (a critic's: values), and forward + backward of a loss.

A micro-batch is the project's `PackedMicroBatch` (slime/backends/packing.py: samples concatenated into
one row, positions restarting per sample, `logit_index` / `target_ids` of the response tokens); here it becomes
Megatron's THD input: `input_ids` / `position_ids` [1, T] and `PackedSeqParams(qkv_format="thd", cu_seqlens)`.
With sequence parallelism the row is padded to a multiple of the TP size by a padding segment of its own (pad id
0), so no real token attends to it. With virtual pipeline stages (several model chunks per rank) megatron's
interleaved 1F1B schedule runs them, each chunk reading its own pass over the micro-batches; the loss and outputs
come from the last chunk of the last stage. Outputs live on the last pipeline stage; what the caller needs
(log-probs, entropy, loss metrics) is broadcast from there to every stage. The loss is computed per micro-batch as the
caller's share of the global loss (no division by the number of micro-batches: `calculate_per_token_loss`).

With context parallelism (context_parallel.py) each sample is padded to a multiple of 2 x CP and this rank feeds its
chunks of the padded row; the targets of the response positions come from the unsplit row (labels shifted before
the split). Each rank computes the outputs of the response positions it holds, and the full per-micro-batch outputs
(in sample order) are summed over the CP group before the loss, which every CP rank then computes identically.

Not the micro-batch schedule (the train flow and packing.py decide which samples form each micro-batch) and not
the loss math (the flow's `loss_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from slime.backends.backend import LossOf
from slime.backends.megatron_utils.context_parallel import (
    CpLayout,
    CpPackedSeqParams,
    context_parallel_group,
    sum_over_context_parallel,
)
from slime.backends.megatron_utils.log_probs import (
    hidden_state_log_probs_and_entropy,
    vocab_parallel_log_probs_and_entropy,
)
from slime.backends.megatron_utils.moe_router import sequence_parallel_routing
from slime.backends.megatron_utils.router_losses import RouterLosses
from slime.backends.packing import PackedMicroBatch, to_device
from slime.backends.routing_replay import RoutingReplay


@dataclass
class ThdInput:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    packed_seq_params: object


def thd_input(micro_batch: PackedMicroBatch, device, pad_multiple: int) -> ThdInput:
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids, position_ids, cu_seqlens = micro_batch.input_ids, micro_batch.position_ids, micro_batch.cu_seqlens
    max_seqlen = micro_batch.max_seqlen
    padding = -micro_batch.num_tokens % pad_multiple
    if padding:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(1, padding)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(padding, dtype=position_ids.dtype)[None]], dim=1)
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + padding])
        max_seqlen = max(max_seqlen, padding)
    cu_seqlens = to_device(cu_seqlens.to(torch.int32), device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    return ThdInput(to_device(input_ids, device), to_device(position_ids, device), params)


@dataclass
class CpRows:
    """Which response positions of a micro-batch this CP rank holds: `held` [num_response_tokens] bool, and
    `local_rows` their rows in this rank's tokens."""

    held: torch.Tensor
    local_rows: torch.Tensor


def context_parallel_thd_input(micro_batch: PackedMicroBatch, device, pad_multiple: int, cp_size: int,
                               cp_rank: int) -> tuple[ThdInput, CpRows]:
    """This CP rank's tokens of the micro-batch (each sample padded to a multiple of 2 x cp_size by pad id 0, a
    padding segment of its own bringing the row to a multiple of 2 x cp_size x `pad_multiple`), with the padded
    full row's cu_seqlens (megatron's RoPE and attention.py split them per rank) and this rank's layout."""
    split = 2 * cp_size
    lengths = micro_batch.cu_seqlens.diff().numpy().astype(np.int64)
    padded = -(-lengths // split) * split
    padding = -int(padded.sum()) % (split * pad_multiple)
    padded_lengths = padded.tolist() + ([padding] if padding else [])
    starts, padded_starts = np.cumsum(lengths) - lengths, np.cumsum(padded) - padded
    shift = np.repeat(padded_starts - starts, lengths)  # row position -> padded row position
    total = sum(padded_lengths)
    input_ids = np.zeros(total, dtype=np.int64)
    input_ids[np.arange(len(shift)) + shift] = micro_batch.input_ids[0].numpy()
    padded_lengths_array = np.asarray(padded_lengths, dtype=np.int64)
    position_ids = np.arange(total) - np.repeat(np.cumsum(padded_lengths_array) - padded_lengths_array,
                                                padded_lengths_array)
    layout = CpLayout.of(padded_lengths, cp_size, cp_rank)
    local_index = layout.local_index.numpy()
    local_row = np.full(total, -1, dtype=np.int64)
    local_row[local_index] = np.arange(len(local_index))
    logit_index = micro_batch.logit_index.numpy()
    rows = local_row[logit_index + shift[logit_index]]
    held = rows >= 0
    cu_seqlens = to_device(torch.from_numpy(np.concatenate([[0], np.cumsum(padded_lengths)])).to(torch.int32), device)
    max_seqlen = max(padded_lengths)
    layout.gather_index = to_device(layout.gather_index, device)
    params = CpPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, cp_layout=layout)
    inputs = ThdInput(to_device(torch.from_numpy(input_ids[local_index])[None], device),
                      to_device(torch.from_numpy(position_ids[local_index])[None], device), params)
    return inputs, CpRows(torch.from_numpy(held), torch.from_numpy(rows[held]))


def _context_parallel_outputs(outputs_of, micro_batch: PackedMicroBatch, cp_rows: CpRows, output: torch.Tensor):
    """The full outputs over the micro-batch's response tokens, on every CP rank, from the rows this rank holds."""
    held = cp_rows.held
    local = replace(micro_batch, logit_index=cp_rows.local_rows, target_ids=micro_batch.target_ids[held])
    local_outputs = outputs_of(local, output)
    group = context_parallel_group()
    held = to_device(held, output.device)

    def full(share: torch.Tensor) -> torch.Tensor:
        scattered = share.new_zeros(held.shape[0]).masked_scatter(held, share)
        return sum_over_context_parallel(scattered, group)

    if isinstance(local_outputs, torch.Tensor):
        return full(local_outputs)
    return tuple(full(tensor) for tensor in local_outputs)


def _pad_multiple(config) -> int:
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _passed_through(micro_batch: PackedMicroBatch, outputs):
    """The outputs a `tile_forward` already computed for the micro-batch's response tokens."""
    return outputs


def _broadcast_from_last_stage(outputs: list) -> list:
    """The last stage's per-micro-batch outputs on every stage (as host tensors and floats; with one stage they
    stay where they are, so the caller copies all micro-batches' outputs to the host at once)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return outputs
    group = parallel_state.get_pipeline_model_parallel_group()
    last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
    holder = [[_to_host(output) for output in outputs]]
    dist.broadcast_object_list(holder, src=last, group=group)
    return holder[0]


def _to_host(output):
    if isinstance(output, dict):
        return {key: float(value) for key, value in output.items()}
    if isinstance(output, torch.Tensor):
        return output.cpu()
    return tuple(tensor.cpu() for tensor in output)


def _detached(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    return tuple(tensor.detach() for tensor in outputs)


def _before_recompute(micro_batch: PackedMicroBatch, routing: torch.Tensor | None,
                      routing_replay: RoutingReplay | None, router_losses: RouterLosses | None,
                      grad: torch.Tensor) -> None:
    if routing_replay is not None:
        routing_replay.set_routing(routing)
    if router_losses is not None:
        router_losses.sample_lengths = micro_batch.cu_seqlens.diff().tolist()


def run_micro_batches(model_chunks, micro_batches: list[PackedMicroBatch], *, temperature: float, vocab_size: int,
                      device, chunk_size: int | None = None, loss_of: LossOf | None = None,
                      routing_replay: RoutingReplay | None = None, router_losses: RouterLosses | None = None,
                      head: Callable[[PackedMicroBatch, torch.Tensor], torch.Tensor] | None = None,
                      tile_forward: Callable | None = None):
    """Forward-only (loss_of None): per micro-batch (log_probs, entropy) of its response tokens, on every rank.
    Otherwise forward + backward of `loss_of(index of the micro-batch, (log_probs, entropy)) -> (loss, metrics)`
    (gradients accumulate in the DDP grad buffers, `param.main_grad`); returns the per-micro-batch metric dicts, on
    every rank. A critic's `head(micro_batch, last-stage output)` gives its values in place of (log_probs, entropy)
    (value_head.py; temperature, vocab_size and chunk_size then play no part). `tile_forward(model, micro_batch)
    -> (log_probs, entropy)` replaces the model's forward under --true-on-policy-mode (true_on_policy.py).
    An MoE policy's `routing_replay` and `router_losses` learn which micro-batch's layers run: each forward runs in
    its micro-batch's routing context, and with activation recompute the gradient reaching a micro-batch's output
    tells them again, since the pipeline schedule recomputes that micro-batch's layers in its backward, after other
    micro-batches' forwards."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    forward_only = loss_of is None
    config = model_chunks[0].config
    pad_multiple = _pad_multiple(config)
    cp_size = config.context_parallel_size
    cp_rank = dist.get_rank(context_parallel_group()) if cp_size > 1 else 0
    last_chunk = model_chunks[-1]
    from_hidden_states = config.tensor_model_parallel_size == 1  # model.py: the output layer passes them through
    outputs = []

    def log_prob_head(micro_batch: PackedMicroBatch, output: torch.Tensor):
        rows = output[0].index_select(0, to_device(micro_batch.logit_index, output.device))
        target_ids = to_device(micro_batch.target_ids, output.device)
        if from_hidden_states:
            return hidden_state_log_probs_and_entropy(last_chunk, rows, target_ids, temperature, vocab_size,
                                                      chunk_size)
        return vocab_parallel_log_probs_and_entropy(rows, target_ids, temperature, vocab_size)

    outputs_of = head or (_passed_through if tile_forward is not None else log_prob_head)

    def loss_func(index: int, micro_batch: PackedMicroBatch, cp_rows: CpRows | None, output: torch.Tensor):
        if cp_rows is None:
            micro_batch_outputs = outputs_of(micro_batch, output)
        else:
            micro_batch_outputs = _context_parallel_outputs(outputs_of, micro_batch, cp_rows, output)
        if forward_only:
            outputs.append(_detached(micro_batch_outputs))
            return (output[0] if isinstance(output, tuple) else output).sum() * 0.0, torch.tensor(1), {}
        loss, metrics = loss_of(index, micro_batch_outputs)
        outputs.append({key: torch.as_tensor(value).detach() for key, value in metrics.items()})
        return loss, torch.tensor(1), {}

    def forward_step(data_iterator, model):
        index, micro_batch = next(data_iterator)
        if tile_forward is not None:
            return tile_forward(model, micro_batch), partial(loss_func, index, micro_batch, None)
        cp_rows = None
        if cp_size > 1:
            inputs, cp_rows = context_parallel_thd_input(micro_batch, device, pad_multiple, cp_size, cp_rank)
        else:
            inputs = thd_input(micro_batch, device, pad_multiple)
        if router_losses is not None:
            router_losses.sample_lengths = micro_batch.cu_seqlens.diff().tolist()
        routing = micro_batch.routed_experts
        if config.sequence_parallel:
            routing = sequence_parallel_routing(routing, inputs.input_ids.shape[1])
        context = nullcontext() if routing_replay is None else routing_replay.micro_batch(routing)
        with context:
            output = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
        routers_follow = routing_replay is not None or router_losses is not None
        if config.recompute_granularity is not None and output.requires_grad and routers_follow:
            output.register_hook(partial(_before_recompute, micro_batch, routing, routing_replay, router_losses))
        return output, partial(loss_func, index, micro_batch, cp_rows)

    for chunk in model_chunks:
        chunk.train(not forward_only)
    # One iterator per model chunk: the interleaved schedule runs each chunk over every micro-batch in order.
    data_iterators = [iter(enumerate(micro_batches)) for _ in model_chunks]
    context = torch.no_grad() if forward_only else torch.enable_grad()
    with context:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data_iterators if len(model_chunks) > 1 else data_iterators[0],
            model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.num_tokens + pad_multiple for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return _broadcast_from_last_stage(outputs)
