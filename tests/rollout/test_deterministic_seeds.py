"""--deterministic-mode's request seeds: a pure function of (--rollout-seed, rollout id, sample index, context
length), different for each of them, and absent without the mode."""

from types import SimpleNamespace

from slime.rollout.deterministic_seeds import SEED_BITS, continuation_seed, request_seed, with_sample_seed


def test_seeds_are_stable_and_differ_per_component():
    base = request_seed(42, 3, 7)
    assert base == request_seed(42, 3, 7)
    others = {request_seed(43, 3, 7), request_seed(42, 4, 7), request_seed(42, 3, 8), request_seed(42, 3, 7, 12)}
    assert base not in others and len(others) == 4
    assert 0 <= base < 1 << SEED_BITS


def test_only_the_mode_sets_seeds():
    params = {"temperature": 1.0}
    off = SimpleNamespace(deterministic_mode=False, rollout_seed=42)
    on = SimpleNamespace(deterministic_mode=True, rollout_seed=42)
    assert with_sample_seed(off, params, 0, 5) == params
    seeded = with_sample_seed(on, params, 0, 5)
    assert seeded == {"temperature": 1.0, "sampling_seed": request_seed(42, 0, 5)}
    later_turn = continuation_seed(on, seeded, 30)
    assert later_turn["sampling_seed"] not in (seeded["sampling_seed"], continuation_seed(on, seeded, 31)["sampling_seed"])
    assert continuation_seed(off, seeded, 30) == seeded
