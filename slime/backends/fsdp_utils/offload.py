"""TrainingStateOffload: the FSDP trainer's colocated offload / onload, by storage (host_storage_copies.py), with the
optimizer state off the critical path.

Every tensor object stays: the parameters FSDP and the optimizer hold, and the optimizer state's DTensors. An offload
releases their storages (zero bytes on the device; the bytes in one pinned host buffer per kind, reused by every
offload), an onload allocates them again and copies the bytes back. From the first onload on, the parameter shards
and the optimizer state each live in one flat buffer per dtype (flat_buffer.py), so a hand-over moves a handful of
storages (one allocation, one copy and one free each: after the offload's empty_cache every allocation is a driver
call) and does no Python work per tensor: wrapping each shard in a new DTensor and swapping it into the module cost
0.15 s of host time per onload for a 0.6B model on the H200's host (RESULTS.md, session 14). The first onload (and one
after the tensors were replaced, e.g. by a checkpoint load) finds other storages than the last placement left: it
places the tensors into new flat buffers from their host bytes and swaps them in (the parameters, so FSDP re-reads
each shard: FSDPModule._apply; a shard it pads gets a storage of its own again) or re-points the state's entries.

Onload brings the parameters back on the compute stream and waits for them (the log-prob pass reads them first;
returning before they landed only moved the wait into that pass, and made it longer: H200, RESULTS.md); the
optimizer state follows on a side stream, after the parameters, while the log-prob pass runs. Offload: right after
the last optimizer step (`to_host_early`) the optimizer state's and the parameters' device-to-host copies start on
the side stream, while the weight push reads the parameters (a read beside a read), so when the push is done the
copies are mostly done too. Every reader or writer of the optimizer state goes through `optimizer_state_touched`
first (FSDPBackend's `optimizer` property): the compute stream waits for a copy in flight, and the host copy stops
counting as the current value, so a later offload copies again; a parameter shard written in place since its early
copy (a weight snapshot's restore, by its version counter) is copied again too. Device memory is freed only after a
device-wide synchronize, when no copy still reads it. While offloaded, the parameters' storages are empty: nothing
may read them (FSDPBackend refuses to gather or save them); `host_value` reads the offloaded bytes.

Not here: the Megatron trainer's offload (megatron_utils/offload.py, by storage too).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import reshard
from slime.backends.host_storage_copies import HostStorageCopies, storage_key, storages_of
from slime.backends.side_stream import SideStream
from slime.utils.flat_buffer import flat_empty

OPTIMIZER_STATE = "optimizer_state"
PARAMETERS = "parameters"
BUFFERS = "buffers"  # the module's buffers and any gradient: restored storage by storage


def moving_state_entries(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str]]:
    """(state dict, key) of every optimizer-state tensor that moves with the parameters. Fused AdamW keeps its step
    counts on the parameters' device; the default one keeps them on the host."""
    move_steps = bool(optimizer.defaults.get("fused"))
    return [(state, key) for state in optimizer.state.values() for key, value in state.items()
            if isinstance(value, torch.Tensor) and (key != "step" or move_steps)]


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter or an optimizer-state tensor (FSDP2's are DTensors)."""
    return value.to_local() if isinstance(value, DTensor) else value


def with_local(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in place of `value`'s local data: a DTensor of the same mesh, placements, shape and stride (from a
    local tensor on the mesh's device: `from_local` moves any other), or `local` itself."""
    if isinstance(value, DTensor):
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return local


@torch.no_grad()
def flat_copies(sources: list[torch.Tensor], device, copying=contextlib.nullcontext()) -> list[torch.Tensor]:
    """Device copies of `sources` (local tensors) in views of one allocation per dtype, allocated on the current
    stream; the non-blocking copies queued inside `copying` (default: on the current stream too)."""
    views = flat_empty([(source.shape, source.dtype) for source in sources], device)
    with copying:
        for view, source in zip(views, sources):
            view.copy_(source, non_blocking=True)
    return views


@torch.no_grad()
def place_parameters(model: torch.nn.Module, device, sources: list[torch.Tensor] | None = None) -> None:
    """Swap the (resharded) parameter shards for copies in one allocation per dtype on `device`, from `sources`
    (their values, one per parameter; default: the shards themselves)."""
    reshard(model)
    params = list(model.parameters())
    views = flat_copies(sources or [local_tensor(param) for param in params], device)
    placed = {id(param): with_local(param, view) for param, view in zip(params, views)}
    swap_module_tensors(model, lambda t: placed.get(id(t), t))


def swap_module_tensors(model: torch.nn.Module, fn) -> None:
    """`model._apply(fn)` swapping each tensor in place, so FSDP's and the optimizer's references stay valid (FSDP
    re-reads each shard after the swap: FSDPModule._apply)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model._apply(fn)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def parameter_storages(params: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    return storages_of(local_tensor(param) for param in params)


def state_storages(optimizer: torch.optim.Optimizer) -> list[torch.UntypedStorage]:
    return storages_of(local_tensor(state[key]) for state, key in moving_state_entries(optimizer))


class TrainingStateOffload:
    def __init__(self, device: torch.device):
        self.device = device
        self.copies = SideStream(device)
        self.host = {kind: HostStorageCopies() for kind in (PARAMETERS, OPTIMIZER_STATE, BUFFERS)}
        self._flat: dict[str, set[int]] = {PARAMETERS: set(), OPTIMIZER_STATE: set()}  # the last placement's storages
        self._state_on_host = False  # the host copy holds the optimizer state's current value
        # the version counters of the parameter shards when their early copy was queued; empty: no early copy stands
        self._early_param_versions: dict[int, int] = {}

    @property
    def offloaded(self) -> bool:
        return self.host[PARAMETERS].released

    def host_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """An offloaded parameter's (or optimizer-state tensor's) value, in its host copy."""
        for kind in (PARAMETERS, OPTIMIZER_STATE):
            try:
                return self.host[kind].host_value(local_tensor(tensor))
            except KeyError:
                continue
        raise KeyError("the tensor was not offloaded")

    def optimizer_state_touched(self) -> None:
        """Called before anything reads or writes the optimizer state: the compute stream waits for its copy in
        flight, and the host copy may be stale from now on."""
        self.copies.wait(OPTIMIZER_STATE)
        self.copies.wait(PARAMETERS)  # a step writes the parameters: not while their early copy reads them
        self._state_on_host = False
        self._early_param_versions = {}  # and the step bumps no version counter the early copy knows of

    @torch.no_grad()
    def optimizer_state_to_host(self, optimizer: torch.optim.Optimizer) -> None:
        """Start copying the (device) optimizer state to the host, after the work queued so far (the last optimizer
        step). The device tensors stay the state until `offload`."""
        with self.copies.copying(OPTIMIZER_STATE):
            self.host[OPTIMIZER_STATE].copy_to_host(state_storages(optimizer))
        self._state_on_host = True

    @torch.no_grad()
    def to_host_early(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After the rollout's last optimizer step: start the optimizer state's and the parameter shards' copies to
        the host; the offload after the weight push then mostly waits for copies already done."""
        self.optimizer_state_to_host(optimizer)
        reshard(model)
        params = list(model.parameters())
        self._parameters_to_host(params, params)
        self._early_param_versions = {id(param): local_tensor(param)._version for param in params}

    def _parameters_to_host(self, params: list[torch.Tensor], stale: list[torch.Tensor]) -> None:
        """Queue the copies of the storages under the `stale` parameters' shards, on the side stream after the
        work queued so far."""
        with self.copies.copying(PARAMETERS):
            self.host[PARAMETERS].copy_to_host(parameter_storages(params), parameter_storages(stale))

    def _early_copy_current(self, param: torch.Tensor) -> bool:
        """Whether `param`'s early host copy still holds the shard's value: no optimizer touch and no in-place
        write since it was queued (views of one buffer share a version counter: a write to any shard there counts
        for all)."""
        version = self._early_param_versions.get(id(param))
        return version is not None and local_tensor(param)._version == version

    @torch.no_grad()
    def offload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Parameters, buffers and optimizer state to the host; returns once every copy is done and the device
        memory released."""
        if self.offloaded:
            raise RuntimeError("the trainer's state is already offloaded; onload it before offloading again")
        if not self._state_on_host:
            self.optimizer_state_to_host(optimizer)
        reshard(model)
        params = list(model.parameters())
        stale = [param for param in params if not self._early_copy_current(param)]
        if stale:  # written since their early copy, or none was made: copied again, into the same host buffer
            self._parameters_to_host(params, stale)
        param_keys = {storage_key(storage) for storage in parameter_storages(params)}
        rest = [storage for storage in storages_of([*model.buffers(),
                                                     *(local_tensor(p.grad) for p in params if p.grad is not None)])
                if storage_key(storage) not in param_keys]  # a buffer viewing a weight leaves with the weights
        self.host[BUFFERS].copy_to_host(rest)
        torch.cuda.synchronize(self.device)  # both streams: every host copy is complete, no copy reads the device
        self.copies.wait(OPTIMIZER_STATE)  # already complete: drop the events
        self.copies.wait(PARAMETERS)
        self._early_param_versions = {}
        self.host[PARAMETERS].release(parameter_storages(params))
        self.host[BUFFERS].release(rest)
        self.host[OPTIMIZER_STATE].release(state_storages(optimizer))
        torch.cuda.empty_cache()

    @torch.no_grad()
    def onload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Parameters and buffers back (waited for); the optimizer state's upload queued behind them on the side
        stream. Nothing offloaded: nothing to do."""
        params_host, state_host = self.host[PARAMETERS], self.host[OPTIMIZER_STATE]
        if params_host.released_only(self._flat[PARAMETERS]):
            params_host.restore()
        elif params_host.released:
            reshard(model)
            params = list(model.parameters())
            place_parameters(model, self.device, [params_host.host_value(local_tensor(p)) for p in params])
            params_host.forget_released()
            self._flat[PARAMETERS] = {storage_key(storage) for storage in parameter_storages(params)}
        self.host[BUFFERS].restore()
        # The state's storages are allocated on the compute stream and copied on the side stream after the
        # parameters (needed first); the compute stream waits for the copies at the first touch, and frees them
        # only after a synchronize.
        if state_host.released_only(self._flat[OPTIMIZER_STATE]):
            state_host.restore(self.copies.copying(OPTIMIZER_STATE))
            self._state_on_host = True  # until the first touch: an offload before it has nothing to copy
        elif state_host.released:
            self._place_state(optimizer)
            self._state_on_host = False  # the host copy is laid out for the old storages
        torch.cuda.current_stream(self.device).synchronize()  # the parameters and buffers only

    def _place_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer state's entries re-pointed at new tensors in one allocation per dtype, their bytes
        uploaded from the host copy on the side stream."""
        state_host = self.host[OPTIMIZER_STATE]
        entries = moving_state_entries(optimizer)
        values = [state[key] for state, key in entries]
        views = flat_copies([state_host.host_value(local_tensor(value)) for value in values], self.device,
                            self.copies.copying(OPTIMIZER_STATE))
        state_host.forget_released()
        for (state, key), value, view in zip(entries, values, views):
            state[key] = with_local(value, view)
        self._flat[OPTIMIZER_STATE] = {storage_key(storage) for storage in storages_of(views)}
