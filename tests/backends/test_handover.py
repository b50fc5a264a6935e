"""The colocated hand-over's CPU-side logic: which weight sets keep a device copy (weight_snapshot.device_tags), when
the trainer's onload may run beside the engines' release (device_room.onload_fits), and
that every reader or writer of the FSDP optimizer state passes through the wait for its copy in flight (the
backend's `optimizer` property), in the order it runs. The CUDA paths themselves: tests/backends/test_handover_gpu.py."""

from pathlib import Path

import pytest

from slime.backends.device_room import ONLOAD_MARGIN_FRACTION, onload_fits
from slime.backends.weight_snapshot import DEVICE_HEADROOM_FRACTION, device_tags
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import make_args, make_train_data, make_trainer

GB = 10**9
TAGS = ["actor", "ref", "teacher"]


def test_device_tags_take_the_longest_prefix_that_fits_beside_reserve_and_headroom():
    total = 100 * GB
    headroom = DEVICE_HEADROOM_FRACTION * total
    room_for = lambda sets: int(headroom + 10 * GB + sets * 2 * GB)
    assert device_tags(TAGS, 2 * GB, room_for(3), total, reserved_bytes=10 * GB) == TAGS
    assert device_tags(TAGS, 2 * GB, room_for(3) - 1, total, reserved_bytes=10 * GB) == ["actor", "ref"]
    assert device_tags(TAGS, 2 * GB, room_for(1), total, reserved_bytes=10 * GB) == ["actor"]
    assert device_tags(TAGS, 2 * GB, room_for(0), total, reserved_bytes=10 * GB) == []
    assert device_tags(TAGS, 2 * GB, int(headroom), total, reserved_bytes=10 * GB) == []  # below the reserve
    assert device_tags(TAGS, 2 * GB, room_for(50), total, reserved_bytes=10 * GB) == TAGS  # never more than asked


def test_an_onload_runs_beside_the_engines_release_only_with_its_margin_free():
    total = 100 * GB
    margin = ONLOAD_MARGIN_FRACTION * total
    assert onload_fits(10 * GB, int(10 * GB + margin), total)
    assert not onload_fits(10 * GB, int(10 * GB + margin) - 1, total)
    assert onload_fits(0, int(margin), total) and not onload_fits(0, 0, total)


EVENTS = []
COPY = {"in_flight": True}  # stands in for the CUDA copy FSDPBackend's optimizer property waits for


def read_state(reader: str, next_copy: bool = True) -> None:
    """A reader of the optimizer state: it must not run while the copy is in flight. A train step's readers (the
    hook, the step) are separate uses, each may follow a new copy; a checkpoint's reads are one use."""
    assert not COPY["in_flight"], f"{reader} touched the optimizer state without waiting ({EVENTS})"
    EVENTS.append(reader)
    COPY["in_flight"] = next_copy


def wait_for_copy() -> None:
    EVENTS.append("wait")
    COPY["in_flight"] = False


def hook_reads_optimizer(args, rollout_id, step_id, model, optimizer, scheduler):
    read_state("hook")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", seed=11)


def test_every_optimizer_state_reader_waits_for_its_copy_first(tiny_checkpoint, tmp_path):
    args = make_args(tiny_checkpoint, "--lr", "1e-3", "--save", tmp_path / "ckpt",
                     "--custom-before-train-step-hook-path", f"{__name__}.hook_reads_optimizer")
    trainer = make_trainer(args)
    backend = trainer.backend
    assert "optimizer" not in vars(backend)  # only the property reaches it
    optimizer = backend._optimizer
    backend._optimizer_state_touched = wait_for_copy
    optimizer.register_step_pre_hook(lambda *_: read_state("step"))
    optimizer.register_state_dict_pre_hook(lambda *_: read_state("state_dict", next_copy=False))
    optimizer.register_load_state_dict_pre_hook(lambda *_: read_state("load_state_dict", next_copy=False))
    EVENTS.clear()
    COPY["in_flight"] = True
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1, num_steps=2))
    assert [event for event in EVENTS if event != "wait"] == ["hook", "step", "hook", "step"]
    COPY["in_flight"] = True
    saved = trainer.save_model(0)
    COPY["in_flight"] = True
    backend.load_training_state(Path(saved))
    assert [event for event in EVENTS if event != "wait"][-2:] == ["state_dict", "load_state_dict"]
    EVENTS.clear()
    backend.reset_optimizer_states()  # writes the moments in place
    assert EVENTS == ["wait"]

