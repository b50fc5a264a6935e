"""HostStorageCopies (slime/backends/host_storage_copies.py) on CPU tensors: bytes leave and come back with every view
valid; a partial copy refreshes only the storages named; a new layout is copied whole; tensors moved from one
storage each into one flat buffer fit the same host buffer; `host_value` reads a released tensor's bytes."""

from __future__ import annotations

import pytest
import torch

from slime.backends.host_storage_copies import HostStorageCopies, storages_of
from slime.utils.flat_buffer import flat_empty


def test_release_and_restore_keep_every_view():
    base = torch.arange(10, dtype=torch.float32)
    view = base[2:5]
    other = torch.tensor([7, 8], dtype=torch.int64)
    copies = HostStorageCopies()
    storages = storages_of([view, base, other])
    assert len(storages) == 2
    copies.copy_to_host(storages)
    copies.release(storages)
    assert base.untyped_storage().nbytes() == 0 and copies.released
    assert torch.equal(copies.host_value(view), torch.tensor([2.0, 3.0, 4.0]))
    assert torch.equal(copies.host_value(other), torch.tensor([7, 8]))
    copies.restore()
    assert not copies.released
    assert torch.equal(base, torch.arange(10, dtype=torch.float32)) and torch.equal(other, torch.tensor([7, 8]))
    view.fill_(-1.0)  # still a view of the restored storage
    assert base[2].item() == -1.0


def test_a_partial_copy_refreshes_only_the_named_storages():
    first, second = torch.zeros(4), torch.zeros(4)
    copies = HostStorageCopies()
    storages = storages_of([first, second])
    copies.copy_to_host(storages)
    first.fill_(1.0)
    second.fill_(2.0)
    copies.copy_to_host(storages, only=storages_of([first]))  # same layout: only `first` is copied
    copies.release(storages)
    copies.restore()
    assert torch.equal(first, torch.ones(4)) and torch.equal(second, torch.zeros(4))
    third = torch.full((3,), 3.0)
    second.fill_(2.0)
    copies.copy_to_host(storages_of([first, second, third]), only=storages_of([third]))  # a new layout: all of it
    copies.release(storages_of([first, second, third]))
    copies.restore()
    assert torch.equal(second, torch.full((4,), 2.0)) and torch.equal(third, torch.full((3,), 3.0))


def test_tensors_moved_into_a_flat_buffer_fit_the_same_host_buffer():
    tensors = [torch.randn(shape) for shape in [(3, 5), (17,), (2, 2, 2)]]
    copies = HostStorageCopies()
    copies.copy_to_host(storages_of(tensors))
    copies.release(storages_of(tensors))
    first_buffer = copies.host_buffer_pointer()
    flat = flat_empty([(t.shape, t.dtype) for t in tensors], "cpu")  # what an onload's placement does
    for view, tensor in zip(flat, tensors):
        view.copy_(copies.host_value(tensor))
    copies.forget_released()
    expected = [view.clone() for view in flat]
    assert len(storages_of(flat)) == 1
    copies.copy_to_host(storages_of(flat))
    copies.release(storages_of(flat))
    assert copies.host_buffer_pointer() == first_buffer
    copies.restore()
    assert all(torch.equal(view, value) for view, value in zip(flat, expected))


def test_releasing_bytes_never_copied_is_refused_and_dropped_bytes_come_back_zeroed():
    copied, never = torch.ones(3), torch.ones(2)
    copies = HostStorageCopies()
    copies.copy_to_host(storages_of([copied]))
    with pytest.raises(AssertionError, match="never copied"):
        copies.release(storages_of([never]))
    copies.release(storages_of([copied]))
    copies.release(storages_of([never]), keep_bytes=False)
    copies.restore()
    assert torch.equal(copied, torch.ones(3)) and torch.equal(never, torch.zeros(2))


def test_no_copy_while_released_and_no_host_value_once_restored():
    tensor = torch.arange(6, dtype=torch.float32)
    copies = HostStorageCopies()
    copies.copy_to_host(storages_of([tensor]))
    with pytest.raises(KeyError):  # not released: the device holds the value, the host copy may be stale
        copies.host_value(tensor)
    copies.release(storages_of([tensor]))
    with pytest.raises(RuntimeError, match="restore first"):  # a new layout would lose the released bytes
        copies.copy_to_host([])
    assert torch.equal(copies.host_value(tensor), torch.arange(6, dtype=torch.float32))
    copies.restore()
    with pytest.raises(KeyError):
        copies.host_value(tensor)
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32))
