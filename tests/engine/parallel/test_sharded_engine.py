"""An engine of two ranks (rank 0 in this process, rank 1 a spawned child over gloo) against the one-rank engine on
the same checkpoint: the same greedy tokens and log-probs (< 1e-5, fp32) through chunked prefill, prefix-cache hits
and decode, for a dense model with GQA, one with fewer K/V heads than ranks, and Qwen3-MoE at TP=2 and TP=2 x EP=2
(routed experts equal); then pushes, release / resume, abort and n-sampling at TP=2."""

import pytest
import torch

from slime.engine.engine import Engine
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.parallel.rank_weights import RankError
from slime.engine.sampling_params import SamplingParams
from slime.utils.tiny_model import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [list(range(30, 57)), list(range(5, 17)), list(range(30, 50)) + [7, 8, 9]]  # 1st and 3rd share 20 tokens
ENGINE = {"device": "cpu", "kvcache_block_size": 4, "num_kvcache_blocks": 96, "max_num_batched_tokens": 24}
MODELS = {  # wide weights so logits spread and a wrong shard shows
    "dense_gqa": {"arch": "qwen3"},  # 4 q / 2 kv heads
    "dense_one_kv_head": {"arch": "qwen3", "num_key_value_heads": 1},  # K/V head replicated on both ranks
    "odd_vocab": {"arch": "qwen3", "embedding_size": 515},  # vocab rows not divisible by 2: padded shards
    "qwen3_moe": {"arch": "qwen3_moe"},
    "glm4_moe": {"arch": "glm4_moe"},  # sigmoid grouped router, shared expert, partial RoPE, a leading dense layer
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: build_tiny_model(tmp_path_factory.mktemp(name), initializer_range=0.3, seed=3, **kwargs)
            for name, kwargs in MODELS.items()}


def run(engine: Engine, prompts=PROMPTS, params=GREEDY, routed=False) -> list[dict]:
    """Every prompt to completion, submitted one after another with steps between (continuous batching, chunked
    prefill and a prefix-cache hit for the third prompt)."""
    rids, results = [], {}
    for prompt in prompts:
        rids.append(engine.add_request(prompt, params, return_routed_experts=routed))
        for output in engine.step():
            results[output.rid] = output
    while len(results) < len(rids) or not all(results[r].finished for r in rids):
        for output in engine.step():
            results[output.rid] = output
    return [results[rid].to_dict() | {"routed": results[rid].routed_experts} for rid in rids]


def assert_same(sharded: list[dict], single: list[dict]) -> None:
    for a, b in zip(sharded, single):
        assert a["output_ids"] == b["output_ids"]
        assert torch.allclose(torch.tensor(a["output_log_probs"]), torch.tensor(b["output_log_probs"]), atol=1e-5,
                              rtol=0)


@pytest.mark.parametrize("model, ep_size, kv", [("dense_gqa", 1, "auto"), ("dense_one_kv_head", 1, "auto"),
                                                ("odd_vocab", 1, "auto"), ("dense_gqa", 1, "fp8_e4m3"),
                                                ("qwen3_moe", 1, "auto"), ("qwen3_moe", 2, "auto"),
                                                ("glm4_moe", 2, "auto")])
def test_two_ranks_give_one_ranks_tokens_and_log_probs(checkpoints, model, ep_size, kv):
    moe = model in ("qwen3_moe", "glm4_moe")
    extra = {"enable_return_routed_experts": True} if moe else {}
    extra["kv_cache_dtype"] = kv  # fp8: both engines round K/V the same way
    single = Engine(str(checkpoints[model]), **ENGINE, **extra)
    expected = run(single, routed=moe)
    sharded = Engine(str(checkpoints[model]), **ENGINE, **extra, tp_size=2, ep_size=ep_size)
    try:
        got = run(sharded, routed=moe)
        assert got[2]["cached_tokens"] >= 16  # the third prompt hit the prefix cache
        assert_same(got, expected)
        if moe:
            for a, b in zip(got, expected):
                assert a["routed"] is not None and (a["routed"] == b["routed"]).all()
        assert [r["rank"] for r in sharded.rank_reports] == [0, 1]
    finally:
        sharded.shutdown()


@pytest.fixture(scope="module")
def sharded(checkpoints):
    engine = Engine(str(checkpoints["dense_gqa"]), **ENGINE, tp_size=2)
    yield engine
    engine.shutdown()


def test_pushes_reach_every_rank(sharded, checkpoints, tmp_path):
    other = build_tiny_model(tmp_path / "other", arch="qwen3", initializer_range=0.3, seed=4)
    fresh = run(Engine(str(other), **ENGINE))
    sharded.update_weights_from_tensors(list(iterate_checkpoint(other)), weight_version="pushed")
    assert_same(run(sharded), fresh)
    assert {r["weight_version"] for r in sharded.rank_reports} == {"pushed"}
    sharded.update_weights_from_disk(str(checkpoints["dense_gqa"]), weight_version="disk")
    assert_same(run(sharded), run(Engine(str(checkpoints["dense_gqa"]), **ENGINE)))
    assert [r["weight_version"] for r in sharded.rank_reports] == ["disk", "disk"]


def test_a_bad_entry_for_one_rank_is_named_and_changes_no_rank(sharded, checkpoints):
    from slime.utils.weight_transport import serialize_named_tensors

    before = run(sharded)
    norm = dict(iterate_checkpoint(checkpoints["dense_gqa"]))["model.norm.weight"]
    good = serialize_named_tensors([("model.norm.weight", norm * 3)])
    bad = serialize_named_tensors([("model.norm.weight", torch.zeros(7))])
    with pytest.raises(RankError, match="engine rank 1: .*model.norm.weight"):
        sharded.update_weights_from_tensors([("model.norm.weight", norm * 3)], "bad", rank_entries=[good, bad])
    assert_same(run(sharded), before)
    assert sharded.weight_version != "bad"


def test_release_resume_abort_and_n_sampling(sharded):
    before = run(sharded)
    sharded.release_memory()
    sharded.resume_memory()
    assert_same(run(sharded), before)
    rid = sharded.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True))
    sharded.step()
    assert sharded.abort_request(rid).finish_reason["type"] == "abort"
    sampled = run(sharded, [PROMPTS[1]] * 4, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True))
    assert len({tuple(r["output_ids"]) for r in sampled}) > 1  # four different draws, all finished
    assert_same(run(sharded), before)  # and greedy is unchanged after all that
