"""LiveWeights: which weight set the backend's live tensors hold, and the switches between the sets for forward-only
passes (the seed's `_switch_model`): a pass under the ref, the OPD teacher or a pushed version saves the actor's
weights, restores the other set, and puts the actor's back after (`under`).

The offloaded trainer's onload when a ref pass comes next (`onload`): the parameters come back holding the ref's
weights, uploaded straight from the ref's host copy (the only wait of the onload), and the actor's own values (the
parameters' pinned host copies, which the offload left as their storage) go to the actor's device copy on a side
stream that nothing reads before the ref pass ends. One weight set is on the hand-over's critical path instead of
two (the parameters and the ref's device copy: 2 x 2.4 GB of fp32 for a 0.6B model over a ~55 GB/s link), and the
ref's device copy is not uploaded at all. Until the ref pass takes them, the live tensors hold the ref: every other
reader of the actor's weights goes through `actor_live` first (TrainFlow's entry points do).

Not here: where the copies live and how they move (weight_snapshot.py), the backend's own onload (it takes the
sources: FSDP's TrainingStateOffload).
"""

from __future__ import annotations

from contextlib import contextmanager

from slime.backends.backend import TrainBackend
from slime.backends.weight_snapshot import WeightSnapshot

ACTOR = "actor"
REF = "ref"


class LiveWeights:
    def __init__(self, snapshot: WeightSnapshot, backend: TrainBackend):
        self.snapshot = snapshot
        self.backend = backend
        self.ref_pass_each_step = False  # set by the flow: every train step starts with a ref pass
        self.onload_into_ref_pass = True  # False: the plain onload always (a benchmark compares the two)
        self.live: str = ACTOR

    def actor_live(self) -> None:
        """The actor's weights in the live tensors (after an onload that left the ref's there, no ref pass took
        them)."""
        if self.live != ACTOR:
            self.snapshot.restore(ACTOR)
            self.live = ACTOR

    @contextmanager
    def under(self, tag: str):
        """The body runs with weight set `tag` in the live tensors; the actor's are back after it."""
        if self.live != tag:
            self.actor_live()
            self.snapshot.save(ACTOR)
            self.snapshot.restore(tag)
            self.live = tag
        try:
            yield
        finally:
            self.actor_live()

    def onloads_into_ref_pass(self) -> bool:
        """Whether the next onload brings the parameters back holding the ref (the module docstring): a ref pass
        starts every step, the backend's onload takes other sources, the ref has a host copy and the actor's
        transient copy lives on the device."""
        snapshot = self.snapshot
        return (self.onload_into_ref_pass and self.ref_pass_each_step and self.backend.onload_takes_sources
                and REF in snapshot.tags and ACTOR in snapshot.placement)

    def offload_bytes_not_coming_back(self) -> int:
        """Device bytes an offload frees that the next onload does not allocate again: the unbacked copies (the
        actor's transient one), unless that onload uploads the actor's copy itself."""
        return 0 if self.onloads_into_ref_pass() else self.snapshot.unbacked_device_bytes()

    def offload(self) -> None:
        self.actor_live()
        self.snapshot.offload()
        self.backend.offload()

    def onload(self) -> None:
        """The weight sets' uploads first (the ref pass reads them first), on a side stream beside the parameters;
        or, offloaded with a ref pass next, the parameters holding the ref (module docstring)."""
        actor_values = list(self.backend.local_weights())
        if self.onloads_into_ref_pass() and not any(tensor.is_cuda for _, tensor in actor_values):
            self.backend.onload(sources=self.snapshot.tags[REF])  # returns once they are on the device
            self.snapshot.upload(ACTOR, actor_values)  # queued after them: the link carries the ref first
            self.snapshot.onload(skip=(REF,))
            self.live = REF
            return
        self.actor_live()
        self.snapshot.onload()
        self.backend.onload()
