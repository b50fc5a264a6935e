"""The bookkeeping of engines that span N ranks: which trainer rank feeds which engine rank (colocated), the
broadcast group's offsets (disaggregated), and the per-rank reports every weight update must come back with."""

import pytest

from slime.backends.engine_ranks import (
    EngineRankError,
    as_engine_map,
    broadcast_layout,
    check_rank_reports,
    colocated_engine,
    group_ranks,
    num_colocated_engines,
)

URL = "http://127.0.0.1:30001"


def test_trainer_rank_r_feeds_engine_r_over_n_as_its_rank_r_mod_n():
    """slime's layout: on 8 devices with engines of 2, trainer rank r and engine r // 2's rank r % 2 share a device;
    group_ranks lists an engine's trainer ranks in engine-rank order, each exactly once."""
    world_size, per_engine = 8, 2
    assert num_colocated_engines(world_size, per_engine) == 4
    for rank in range(world_size):
        engine = colocated_engine(rank, per_engine, world_size)
        assert engine == rank // per_engine
        assert group_ranks(engine, per_engine)[rank % per_engine] == rank
    assert sorted(r for e in range(4) for r in group_ranks(e, per_engine)) == list(range(world_size))
    assert [group_ranks(e, 4) for e in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_an_incomplete_group_feeds_no_engine():
    """3 trainer ranks, engines of 2: ranks 0-1 feed engine 0; rank 2 holds only half of engine 1's devices, so
    engine 1 is rank 0's to feed."""
    assert [colocated_engine(r, 2, 3) for r in range(3)] == [0, 0, None]
    assert num_colocated_engines(3, 2) == 1
    assert [colocated_engine(r, 1, 3) for r in range(3)] == [0, 1, 2]


def test_broadcast_layout_puts_every_engine_rank_after_the_trainer():
    """world size = 1 + every engine's ranks; engine i's offset = 1 + the ranks of the engines before it (slime's
    rank_offset), whatever order the map comes in."""
    assert broadcast_layout({0: 2, 1: 2, 2: 2}) == (7, {0: 1, 1: 3, 2: 5})
    assert broadcast_layout({3: 4, 0: 1}) == (6, {0: 1, 3: 2})
    assert broadcast_layout({0: 1}) == (2, {0: 1})
    world_size, offsets = broadcast_layout({0: 2, 1: 4})
    engine_ranks = [offsets[e] + r for e, n in ((0, 2), (1, 4)) for r in range(n)]
    assert sorted(engine_ranks) == list(range(1, world_size))  # each group rank once, rank 0 the trainer's
    with pytest.raises(ValueError, match="engine 1 has 0 ranks"):
        broadcast_layout({0: 2, 1: 0})


def test_engine_maps():
    assert as_engine_map(["a", "b"]) == {0: "a", 1: "b"}
    assert as_engine_map({2: "c", 0: "a"}) == {0: "a", 2: "c"}
    assert list(as_engine_map({2: "c", 0: "a"})) == [0, 2]


def reports(*versions):
    return {"success": True, "ranks": [{"rank": r, "weight_version": v, "checksum": 1.5 * r}
                                       for r, v in enumerate(versions)]}


def test_every_rank_at_the_pushed_version_passes():
    check_rank_reports(URL, reports("7", "7"), 2, "7", required=True)
    check_rank_reports(URL, reports("3", "3", "3", "3"), 4, None, required=True)  # a bucket before the last
    check_rank_reports(URL, {"success": True}, 2, "7", required=False)  # SGLang's answer: no reports


@pytest.mark.parametrize("response, num_ranks, version, message", [
    (reports("7", "6"), 2, "7", f"engine {URL}: rank 1 holds weight version '6' after the push of version '7'"),
    (reports("7"), 2, "7", f"engine {URL}: rank 1 did not report the weight update"),
    (reports("7", "7", "7"), 2, "7", r"reported rank\(s\) \[2\], but it has 2 rank"),
    ({"ranks": [{"rank": 0, "weight_version": "7"}, {"rank": 0, "weight_version": "7"}]}, 2, "7",
     "rank 0 reported twice"),
    ({"ranks": "all fine"}, 1, "7", "must be a list"),
    ({"success": True}, 2, "7", "without its per-rank reports"),
])
def test_a_rank_that_missed_the_push_is_named(response, num_ranks, version, message):
    with pytest.raises(EngineRankError, match=message):
        check_rank_reports(URL, response, num_ranks, version, required=True)
