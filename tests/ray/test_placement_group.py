"""Where an engine of N devices lands: engine i takes the rollout's positions [i*N, (i+1)*N), its actor the first
of them and its server all N devices, which must share one node."""

import pytest

from slime.ray.placement_group import DevicePlacement


def gpu_placement(node_ids):
    num = len(node_ids)
    return DevicePlacement(pg=None, bundle_indices=list(range(num)), use_gpu=True,
                           device_ids=[str(i % 8) for i in range(num)], node_ids=node_ids)


def test_engine_i_takes_devices_i_n_to_i_plus_1_n():
    placement = gpu_placement(["a"] * 8)
    assert [placement.engine_positions(i, 2) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [placement.engine_device_ids(i, 4) for i in range(2)] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    # colocated: trainer rank r's device (position r) is engine r // N's rank r % N
    for rank in range(8):
        assert placement.engine_device_ids(rank // 2, 2)[rank % 2] == placement.device_ids[rank]


def test_an_engine_beyond_the_rollout_devices_is_an_error():
    with pytest.raises(ValueError, match="engine 2 of 2 devices needs rollout positions"):
        gpu_placement(["a"] * 4).engine_positions(2, 2)


def test_an_engine_across_two_nodes_is_refused():
    placement = gpu_placement(["a"] * 3 + ["b"] * 3)
    assert placement.engine_device_ids(0, 2) == ["0", "1"]
    with pytest.raises(RuntimeError, match="engine 1's 2 devices .* lie on 2 nodes"):
        placement.engine_device_ids(1, 2)


def test_cpu_engines_keep_the_bookkeeping_without_device_ids():
    placement = DevicePlacement(pg=None, bundle_indices=[4, 5, 6, 7], use_gpu=False)
    assert placement.engine_positions(1, 2) == [2, 3]
    assert placement.bundle_indices[placement.engine_positions(1, 2)[0]] == 6
    assert placement.engine_device_ids(1, 2) is None
