"""TrainingStateOffload: the FSDP trainer's colocated offload / onload, with the optimizer state off the critical
path.

Onload brings the parameters back on the compute stream and waits for them (the log-prob pass reads them first;
returning before they landed only moved the wait into that pass, and made it longer: H200, RESULTS.md); the
optimizer state follows on a side stream from its pinned host copies, after the parameters, while the log-prob pass
runs. Offload: right after the last optimizer step (`to_host_early`) the optimizer state's
and the parameters' device-to-host copies start on the side stream, while the weight push reads the parameters (a
read beside a read), so when the push is done the copies are mostly done too. Every reader or writer of the
optimizer state goes through `optimizer_state_touched` first (FSDPBackend's `optimizer` property): the compute
stream waits for a copy in flight, and the host buffers stop counting as the current value, so a later offload
copies again; a parameter shard written in place since its early copy (a weight snapshot's restore, by its version
counter) is copied again too. Device memory is freed only after a device-wide synchronize, when no copy still reads
it.

Parameters are swapped in place (the optimizer's references stay valid); gathered parameters (the root's, and every
layer's with --no-reshard-after-forward) are freed first, so only the shards move. On the way back to the device,
parameters and optimizer state each land in one allocation per dtype (flat_buffer.py), not one per tensor: after
the offload's empty_cache every allocation is a driver call, and every free another. To the host they go through
`.to(non_blocking=True)`, which pins from the caching host allocator, once: later offloads copy into the same host
tensors.

Not here: the Megatron trainer's offload (megatron_utils/offload.py, by storage).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import reshard
from slime.backends.side_stream import SideStream
from slime.utils.flat_buffer import flat_empty

OPTIMIZER_STATE = "optimizer_state"
PARAMETERS = "parameters"


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, on_device: bool) -> list[tuple[tuple, dict, str]]:
    """((parameter id, state key), state dict, key) of every optimizer-state tensor that moves with the parameters,
    among those now on the device (`on_device`) or on the host. Fused AdamW keeps its step counts on the parameters'
    device; the default one keeps them on the host."""
    move_steps = bool(optimizer.defaults.get("fused"))
    return [((id(param), key), state, key) for param, state in optimizer.state.items() for key, value in state.items()
            if isinstance(value, torch.Tensor) and (key != "step" or move_steps) and local_tensor(value).is_cuda == on_device]


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an optimizer-state tensor (FSDP2's state is DTensors, like its parameters)."""
    return value.to_local() if isinstance(value, DTensor) else value


def with_local(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in place of `value`'s local data: a DTensor of the same mesh, placements, shape and stride (from a
    local tensor on the mesh's device: `from_local` moves any other), or `local` itself."""
    if isinstance(value, DTensor):
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return local


@torch.no_grad()
def into_host_copy(host: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`value`'s host copy, queued: into `host` (its last host copy) when that has the same layout, else a new one
    (pinned, from the caching host allocator). So the run pins one set of host buffers: a new set per offload would
    pin another 4.8 GB for a 0.6B model while the last is still referenced (likely most of the 1.7 s unaccounted in
    an H200 run's second rollout). The last copy's readers are done or ordered before: the onload's uploads from it
    were queued earlier, and each copy into it starts after the work queued so far (SideStream.copying)."""
    source = local_tensor(value)
    if host is None or local_tensor(host).shape != source.shape or local_tensor(host).dtype != source.dtype:
        return value.to("cpu", non_blocking=True)
    local_tensor(host).copy_(source, non_blocking=True)
    return host


@torch.no_grad()
def uploaded(values: list[torch.Tensor], device, copying=contextlib.nullcontext()) -> list[torch.Tensor]:
    """Device copies of `values` (host tensors or DTensors with host shards) in views of one allocation per dtype
    (flat_buffer.py), allocated on the current stream; the non-blocking copies queued inside `copying` (default:
    on the current stream too)."""
    locals_ = [local_tensor(value) for value in values]
    views = flat_empty([(local.shape, local.dtype) for local in locals_], device)
    with copying:
        for view, local in zip(views, locals_):
            view.copy_(local, non_blocking=True)
    return [with_local(value, view) for value, view in zip(values, views)]


def parameters_to_device(model: torch.nn.Module, device) -> None:
    """Swap the model's (resharded) parameter shards back to `device`, non-blocking, into one flat allocation per
    dtype (`place_parameters`), unless they are there already."""
    reshard(model)
    if not all(local_tensor(param).is_cuda for param in model.parameters()):
        place_parameters(model, device)


def place_parameters(model: torch.nn.Module, device) -> None:
    """Copy the (resharded) parameter shards into one allocation per dtype on `device` and swap them in; buffers
    (and any gradient) move one by one."""
    params = list(model.parameters())
    placed = {id(param): moved for param, moved in zip(params, uploaded(params, device))}
    swap_module_tensors(model, lambda t: placed[id(t)] if id(t) in placed else t.to(device, non_blocking=True))


def swap_module_tensors(model: torch.nn.Module, fn) -> None:
    """`model._apply(fn)` swapping each tensor in place, so FSDP's and the optimizer's references stay valid (FSDP
    re-reads each shard after the swap: FSDPModule._apply)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model._apply(fn)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


class TrainingStateOffload:
    def __init__(self, device: torch.device):
        self.device = device
        self.copies = SideStream(device)
        # (parameter id, state key) -> the state tensor's host copy (pinned: DTensor.to("cpu", non_blocking=True)
        # takes it from the caching host allocator, which reuses it across offloads)
        self._host: dict[tuple[int, str], torch.Tensor] = {}
        self._host_current = False  # the host copies hold the optimizer state's current value
        # parameter id -> its shard's host copy (pinned, reused across offloads like the state's), and the version
        # counters of the device shards when their early copy was queued; empty: no early copy stands
        self._host_params: dict[int, torch.Tensor] = {}
        self._early_param_versions: dict[int, int] = {}

    def optimizer_state_touched(self) -> None:
        """Called before anything reads or writes the optimizer state: the compute stream waits for its copy in
        flight, and the host copies may be stale from now on."""
        self.copies.wait(OPTIMIZER_STATE)
        self.copies.wait(PARAMETERS)  # a step writes the parameters: not while their early copy reads them
        self._host_current = False
        self._early_param_versions = {}  # and the step bumps no version counter: the early copy is stale

    def optimizer_state_to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """Start copying the (device) optimizer state to the host, after the work queued so far (the last optimizer
        step). The device tensors stay the state until `offload`. DTensor's own `.to` moves each rank's shard and
        keeps the layout (a DTensor built with `from_local` would move a host shard back to the mesh's device)."""
        entries = optimizer_state_tensors(optimizer, on_device=True)
        with self.copies.copying(OPTIMIZER_STATE):
            self._host = {id_key: into_host_copy(self._host.get(id_key), state[key]) for id_key, state, key in entries}
        self._host_current = True

    def to_host_early(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After the rollout's last optimizer step: start the optimizer state's and the parameter shards' copies to
        the host; the offload after the weight push then mostly waits for copies already done."""
        self.optimizer_state_to_host(optimizer)
        reshard(model)
        params = list(model.parameters())
        self._parameters_to_host(params)
        self._early_param_versions = {id(param): local_tensor(param)._version for param in params}

    def _parameters_to_host(self, params: list[torch.Tensor]) -> None:
        """Queue the copies of `params`' shards into their host copies (new ones the first time), on the side
        stream after the work queued so far."""
        with self.copies.copying(PARAMETERS):
            self._host_params.update((id(param), into_host_copy(self._host_params.get(id(param)), param))
                                     for param in params)

    def _early_copy_current(self, param: torch.Tensor) -> bool:
        """Whether `param`'s early host copy still holds the shard's value: no optimizer touch and no in-place
        write since it was queued."""
        version = self._early_param_versions.get(id(param))
        return version is not None and local_tensor(param)._version == version

    def offload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Parameters and optimizer state to the host; returns once every copy is done and the cache released."""
        if not self._host_current:
            self.optimizer_state_to_host(optimizer)
        reshard(model)
        params = list(model.parameters())
        stale = [param for param in params if not self._early_copy_current(param)]
        if stale:  # written since their early copy, or none was made: copied again, into the same host buffers
            self._parameters_to_host(stale)
        torch.cuda.synchronize(self.device)  # both streams: every host copy is complete, no copy reads the device
        self.copies.wait(OPTIMIZER_STATE)  # already complete: drop the events
        self.copies.wait(PARAMETERS)
        self._early_param_versions = {}
        # The parameters take their host copies' storage (as new Parameter objects: the host copies stay as they
        # are, the next early copy writes into them); gradients and buffers move one by one.
        on_host = {id(param): self._host_params[id(param)] for param in params}
        swap_module_tensors(model, lambda t: on_host[id(t)] if id(t) in on_host else t.to("cpu", non_blocking=True))
        torch.cuda.synchronize(self.device)  # the gradients' and buffers' copies
        for id_key, state, key in optimizer_state_tensors(optimizer, on_device=True):
            state[key] = self._host[id_key]
        torch.cuda.empty_cache()

    def onload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Parameters back (waited for); the optimizer state's upload queued behind them on the side stream."""
        parameters_to_device(model, self.device)
        entries = optimizer_state_tensors(optimizer, on_device=False)
        from_host_copies = (not optimizer_state_tensors(optimizer, on_device=True)
                            and all(state[key] is self._host.get(id_key) for id_key, state, key in entries))
        # Allocated on the compute stream, copied on the side stream after the parameters (they are needed first);
        # the compute stream waits for the copies at the first touch, and frees them only after a synchronize.
        moved = uploaded([state[key] for _, state, key in entries], self.device, self.copies.copying(OPTIMIZER_STATE))
        for (_, state, key), value in zip(entries, moved):
            state[key] = value
        self._host_current = from_host_copies  # until the first touch: an offload before it has nothing to copy
        torch.cuda.current_stream(self.device).synchronize()  # the parameters only
