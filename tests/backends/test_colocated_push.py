"""The colocated weight push of a trainer of several ranks: trainer rank r feeds engine r // N as its rank r % N.

Real gloo trainer processes (FSDP, tiny Qwen3) and real engine servers on 127.0.0.1. With engines of one rank each
trainer rank POSTs its own handle to its own engine; with an engine of two ranks the two trainer ranks gather their
handles to rank 0, which POSTs the list of two. After the push every engine's log-probs of its own sample equal the
trainer's weights run through transformers (1e-4), and before it they did not (the engines start from a checkpoint
of another seed); a push to engine 1 alone (a restarted engine) comes from trainer rank 1 only. What each trainer
rank POSTed is recorded by a pass-through spy on its own `_post`.
"""

import pytest
import torch

from slime.backends import weight_sender
from slime.backends.colocated_feeders import ColocatedFeeders
from slime.engine.server.launch import launch_server
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import (
    full_params,
    make_args,
    make_train_data,
    make_trainer,
    rank_slice,
    run_distributed,
)

ENGINE_SEED, TRAINER_SEED = 9, 8
PROMPT = list(range(3, 35))
SAMPLING = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}
PUSH = "/update_weights_from_tensor"


def _feeders_rank(rank, world_size, port, per_engine):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    feeders = ColocatedFeeders(rank, world_size, per_engine)
    feeders.ensure_groups()
    gathered = feeders.gather(f"entry-{rank}") if feeders.engine is not None else None
    merged = feeders.merge_to_rank0([f"lost-{rank}"])
    return {"engine": feeders.engine, "first": feeders.is_first, "gathered": gathered, "merged": merged}


def test_feeders_gather_each_engines_entries_in_rank_order():
    """5 trainer ranks, engines of 2: ranks 0-1 and 2-3 gather to 0 and 2 (entry i from rank first + i); rank 4
    feeds no engine (its group is incomplete) but still takes part in every collective; rank 0 collects everyone's
    unreachable engines."""
    results = run_distributed(_feeders_rank, 5, 2)
    assert [r["engine"] for r in results] == [0, 0, 1, 1, None]
    assert [r["first"] for r in results] == [True, False, True, False, False]
    assert [r["gathered"] for r in results] == [["entry-0", "entry-1"], None, ["entry-2", "entry-3"], None, None]
    assert results[0]["merged"] == [f"lost-{r}" for r in range(5)]
    assert results[3]["merged"] == ["lost-3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("colocated_push")
    return (build_tiny_model(root / "engine", arch="qwen3", seed=ENGINE_SEED),
            build_tiny_model(root / "trainer", arch="qwen3", seed=TRAINER_SEED))


def _generate(url):
    import httpx

    response = httpx.post(url + "/generate", timeout=120, trust_env=False, json={
        "input_ids": PROMPT, "return_logprob": True, "sampling_params": SAMPLING})
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]], meta


def _reference_log_probs(checkpoint, params, tokens, response_length):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.func.functional_call(model, params, (torch.tensor([tokens]),)).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return torch.stack([log_probs[p - 1, tokens[p]] for p in range(len(tokens) - response_length, len(tokens))])


def _push_rank(rank, world_size, port, checkpoint, per_engine, engines):
    args = make_args(checkpoint, "--colocate", "--rollout-num-gpus-per-engine", per_engine, "--lr", "3e-2",
                     "--micro-batch-size", "2", "--update-weight-buffer-size", "20000", world_size=world_size)
    trainer = make_trainer(args, rank, world_size, port)
    trainer.train(1, rank_slice(make_train_data(8, vocab_size=300, seed=1), rank, world_size))
    posts, real_post = [], weight_sender._post

    def recording_post(url, path, payload, headers=None):
        if path == PUSH:
            posts.append((url, len(payload["serialized_named_tensors"]), payload.get("weight_version")))
        return real_post(url, path, payload, headers)

    weight_sender._post = recording_post
    result = trainer.update_weights(engines, weight_version="5", mode="tensor")
    params = {name.removeprefix("hf_model."): value.cpu() for name, value in full_params(trainer).items()}
    full_posts, posts[:] = list(posts), []
    if len(engines) == 2:  # a restarted engine 1 alone (fault tolerance): only its trainer rank sends
        trainer.update_weights({1: engines[1]}, weight_version="6", mode="tensor")
    return {"posts": full_posts, "buckets": result.num_buckets, "unreachable": result.unreachable_engines,
            "params": params if rank == 0 else None, "partial_posts": posts}


@pytest.mark.slow
@pytest.mark.parametrize("per_engine", [1, 2])
def test_each_trainer_rank_feeds_its_colocated_engine_rank(checkpoints, tmp_path, per_engine):
    engine_checkpoint, trainer_checkpoint = checkpoints
    num_engines = 2 // per_engine
    servers = [launch_server(engine_checkpoint, log_path=tmp_path / f"engine_{i}.log", env={"OMP_NUM_THREADS": "1"},
                             extra_args=["--device", "cpu", "--tp-size", str(per_engine)])
               for i in range(num_engines)]
    try:
        engines = {i: server.url for i, server in enumerate(servers)}
        before = {i: _generate(url) for i, url in engines.items()}
        # A short join: the ranks' torch_shm_manager (file_system sharing) outlives them holding their exit pipes.
        ranks = run_distributed(_push_rank, 2, trainer_checkpoint, per_engine, engines, timeout=10)
        num_buckets = ranks[0]["buckets"]
        assert num_buckets > 2 and ranks[1]["buckets"] == num_buckets and ranks[0]["unreachable"] == []
        if per_engine == 1:  # each rank its own engine, one entry per request, the version on the last
            for rank in range(2):
                assert [(url, n) for url, n, _ in ranks[rank]["posts"]] == [(engines[rank], 1)] * num_buckets
            assert ranks[0]["partial_posts"] == []
            assert [(url, n) for url, n, _ in ranks[1]["partial_posts"]] == [(engines[1], 1)] * num_buckets
        else:  # the group's first rank POSTs both entries; rank 1 POSTs nothing
            assert [(url, n) for url, n, _ in ranks[0]["posts"]] == [(engines[0], 2)] * num_buckets
            assert ranks[1]["posts"] == []
        for rank in range(2):
            versions = [version for _, _, version in ranks[rank]["posts"]]
            assert versions == ([None] * (len(versions) - 1) + ["5"] if versions else [])
        params = ranks[0]["params"]
        for i, url in engines.items():
            output_ids, log_probs, meta = _generate(url)
            assert meta["weight_version"] == ("6" if i == 1 else "5")
            tokens = PROMPT + output_ids
            expected = _reference_log_probs(trainer_checkpoint, params, tokens, len(output_ids))
            torch.testing.assert_close(torch.tensor(log_probs), expected, rtol=0, atol=1e-4)
            stale_ids, stale_log_probs, _ = before[i]
            stale_expected = _reference_log_probs(trainer_checkpoint, params, PROMPT + stale_ids, len(stale_ids))
            assert (torch.tensor(stale_log_probs) - stale_expected).abs().max() > 1e-2  # the push changed it
    finally:
        for server in servers:
            server.stop()
