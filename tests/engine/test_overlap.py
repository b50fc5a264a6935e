"""Overlapped scheduling (`overlap_schedule=True`) against the plain step loop on the same requests: identical
tokens, log-probs and finish reasons with seeded sampling, through stops at random steps (stop tokens and stop
strings, whose look-ahead token is dropped), length limits, preemption when KV blocks run out, requests arriving
mid-run, aborts and weight updates, chunked prefill scheduled ahead (overlap_prefill); and the look-ahead really
runs (it is counted)."""

import pytest
import torch

from slime.engine.engine import Engine
from slime.engine.sequence import PLACEHOLDER


@pytest.fixture(scope="module")
def path(tiny_qwen3):
    return str(tiny_qwen3)


def requests(num: int = 6):
    """Seeded sampling at T=1; some stop on frequent token ids or on a stop string, lengths differ."""
    prompts = [[5 + i, 17, 29 + i, 41, 53 + 2 * i] for i in range(num)]
    params = []
    for i in range(num):
        p = {"temperature": 1.0, "max_new_tokens": 6 + 3 * i, "sampling_seed": 1000 + i}
        if i % 3 == 1:
            p["stop_token_ids"] = list(range(40, 140))  # likely to stop within a few tokens
        if i % 3 == 2:
            p["stop"] = ["e"]
        params.append(p)
    return prompts, params


def run(path, overlap: bool, prompts, params, count=None, **config):
    engine = Engine(path, **{"device": "cpu", **config}, overlap_schedule=overlap)
    if count is not None:
        original = engine.scheduler.look_ahead

        def counting(batch):
            ahead = original(batch)
            count["ahead"] += bool(ahead)
            return ahead

        engine.scheduler.look_ahead = counting
        original_ahead = engine.scheduler.schedule_ahead

        def counting_ahead(batch):
            ahead = original_ahead(batch)
            assert ahead is None or len(ahead) == len(engine.scheduler.running)  # no running sequence left out
            count["prefill_ahead"] = count.get("prefill_ahead", 0) + bool(ahead)
            count["declined"] = count.get("declined", 0) + (ahead is None)
            # a step with both rows fed from the device and prefill chunks
            count["mixed"] = count.get("mixed", 0) + bool(ahead and any(i.seq.has_placeholder for i in ahead)
                                                          and any(not i.needs_sample for i in ahead))
            return ahead

        engine.scheduler.schedule_ahead = counting_ahead
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    sequences = dict(engine.requests)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert PLACEHOLDER not in output.output_token_ids
            if output.finished:
                finished[output.rid] = output.to_dict()
    for rid in rids:  # a token sampled ahead for a finished request never lands on it
        assert sequences[rid].output_token_ids == finished[rid]["output_ids"]
    # Prefix-cache entries only ever cover real tokens.
    assert all(PLACEHOLDER not in (block.token_ids or ()) for block in engine.block_manager.blocks)
    return [finished[rid] for rid in rids]


def assert_same(got, expected):
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert [o["finish_reason"] for o in got] == [o["finish_reason"] for o in expected]
    assert [o["text"] for o in got] == [o["text"] for o in expected]
    for a, b in zip(got, expected):
        assert a["output_log_probs"] == pytest.approx(b["output_log_probs"], abs=1e-5)


def test_overlap_gives_the_same_tokens_and_runs_ahead(path):
    prompts, params = requests()
    count = {"ahead": 0}
    plain = run(path, False, prompts, params)
    overlapped = run(path, True, prompts, params, count)
    assert_same(overlapped, plain)
    assert count["ahead"] >= 5
    reasons = {o["finish_reason"]["type"] for o in plain}
    assert reasons == {"stop", "length"}  # both kinds of ending are exercised


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_cuda_graphs_gives_the_same_tokens(path):
    """On the GPU the look-ahead's input tokens are gathered on the device and fed to captured CUDA graphs."""
    prompts, params = requests(8)
    cuda = dict(device="cuda", dtype="float32", num_kvcache_blocks=256)
    count = {"ahead": 0}
    assert_same(run(path, True, prompts, params, count, **cuda), run(path, False, prompts, params, **cuda))
    assert count["ahead"] >= 5
    # Chunked prefill overlapped: decode rows fed from the device in eager mixed steps and in decode graphs.
    prompts, params = chunked_requests()
    cuda["max_num_batched_tokens"] = 16
    count = {"ahead": 0}
    assert_same(run(path, True, prompts, params, count, **cuda), run(path, False, prompts, params, **cuda))
    assert count["prefill_ahead"] >= 10 and count["mixed"] >= 3
    assert Engine(path, **cuda).model_runner.use_cuda_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_collecting_a_step_does_not_wait_for_work_queued_after_it(path):
    """The results' host copy is queued at launch: collecting step N must not wait for step N+1's kernels, or the
    overlapped loop would serialise host and GPU again (stand-in for step N+1: a second of GPU sleep)."""
    engine = Engine(path, device="cuda", dtype="float32", num_kvcache_blocks=256)
    prompts, params = requests(4)
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    runner = engine.model_runner
    for _ in range(2):  # the prefill step, then a decode step on CUDA graphs
        scheduled = engine.scheduler.schedule()
        launched = runner.launch(scheduled)
        torch.cuda._sleep(2_000_000_000)
        token_ids, log_probs = runner.collect(launched)
        assert not torch.cuda.current_stream().query(), "collect waited for GPU work queued after its step"
        assert token_ids == launched.tokens.tolist() and len(log_probs) == len(scheduled)
        assert all(lp <= 0 for lp in log_probs)
        engine.scheduler.postprocess(scheduled, token_ids, log_probs)
        torch.cuda.synchronize()


def chunked_requests(num: int = 8):
    """Prompts of 11-32 tokens, longer than a 16-token step budget (chunked prefill, later prompts admitted while
    earlier ones decode), seeded T=1 sampling, stop tokens and stop strings as in `requests`."""
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(11 + 3 * i)] for i in range(num)]
    _, params = requests(num)
    return prompts, params


def test_overlapped_prefill_gives_the_same_tokens_and_runs_ahead(path):
    """Steps after prefill chunks are launched before the chunk's tokens reach the host (their decode rows read
    them on the device, in steps that also hold prefill chunks): same tokens, log-probs and finish reasons as the
    plain loop and as overlap without it, which never schedules a prefill step ahead."""
    prompts, params = chunked_requests()
    budget = dict(max_num_batched_tokens=16)
    plain = run(path, False, prompts, params, **budget)
    count, count_off = {"ahead": 0}, {"ahead": 0}
    assert_same(run(path, True, prompts, params, count, **budget), plain)
    assert count["prefill_ahead"] >= 10 and count["mixed"] >= 3
    assert_same(run(path, True, prompts, params, count_off, overlap_prefill=False, **budget), plain)
    assert count_off.get("prefill_ahead", 0) == 0
    with pytest.raises(ValueError, match="overlap_prefill must be a bool"):
        Engine(path, device="cpu", overlap_prefill=1)


def test_overlapped_prefill_declines_when_blocks_may_run_out(path):
    """With too few KV blocks the step after a prefill chunk is not scheduled ahead (a preemption needs the real
    tokens): same tokens as the plain loop, and the decline happened."""
    prompts, params = chunked_requests(6)
    kv = dict(max_num_batched_tokens=16, kvcache_block_size=4, num_kvcache_blocks=24)
    count = {"ahead": 0}
    assert_same(run(path, True, prompts, params, count, **kv), run(path, False, prompts, params, **kv))
    assert count["declined"] >= 1 and count["prefill_ahead"] >= 1


def test_overlap_under_preemption_and_tiny_blocks(path):
    prompts, params = requests()
    kv = dict(kvcache_block_size=4, num_kvcache_blocks=14)  # too few blocks: look-ahead must back off
    assert_same(run(path, True, prompts, params, **kv), run(path, False, prompts, params, **kv))


def test_requests_arriving_mid_run_and_abort(path):
    prompts, params = requests(4)
    results = {}
    for overlap in (False, True):
        engine = Engine(path, device="cpu", overlap_schedule=overlap)
        rids = [engine.add_request(prompts[0], params[0]), engine.add_request(prompts[3], params[3])]
        outputs, aborted = {}, None
        for step in range(40):
            if step == 2:
                rids.append(engine.add_request(prompts[1], params[1]))
            if step == 4:
                aborted = engine.abort_request(rids[1]).to_dict()
            for output in engine.step():
                if output.finished:
                    outputs[output.rid] = output.to_dict()
            if not engine.has_unfinished_requests():
                break
        results[overlap] = ([outputs[r]["output_ids"] for r in rids if r in outputs], aborted)
    plain_outputs, plain_aborted = results[False]
    overlap_outputs, overlap_aborted = results[True]
    assert overlap_outputs == plain_outputs
    # The abort lands at a different step (overlap reports a step later), so the partial outputs are prefixes
    # of one another, and both are aborts.
    assert overlap_aborted["finish_reason"]["type"] == plain_aborted["finish_reason"]["type"] == "abort"
    shorter, longer = sorted([overlap_aborted["output_ids"], plain_aborted["output_ids"]], key=len)
    assert longer[: len(shorter)] == shorter


def test_weights_pushed_mid_run_apply_to_later_steps(path):
    """A weight update drains the step in flight, then every later token comes from the new weights: same tokens
    as the plain loop given the same update at the same call."""
    prompts, _ = requests(3)
    greedy = [{"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}] * 3
    tokens = {}
    for overlap in (False, True):
        engine = Engine(path, device="cpu", overlap_schedule=overlap)
        shapes = engine.named_weight_shapes()
        rids = [engine.add_request(p, q) for p, q in zip(prompts, greedy)]
        finished = {}
        for step in range(60):
            if step == 4:
                name = "model.layers.0.mlp.down_proj.weight"
                new_weight = torch.randn(shapes[name][0], generator=torch.Generator().manual_seed(0))
                engine.update_weights_from_tensors([(name, new_weight)])
            for output in engine.step():
                if output.finished:
                    finished[output.rid] = output.output_token_ids
            if not engine.has_unfinished_requests():
                break
        tokens[overlap] = [finished[r] for r in rids]
    # Both loops have sampled 4 tokens per sequence when the update arrives (the overlapped one finishes the step
    # in flight first), so every token matches, and the update changed the later ones.
    assert tokens[True] == tokens[False]
    untouched = Engine(path, device="cpu")
    assert [o["output_ids"] for o in untouched.generate(prompts, greedy)] != tokens[False]


def test_overlap_flag_is_validated_and_defaults_by_device(path):
    with pytest.raises(ValueError, match="overlap_schedule must be a bool"):
        Engine(path, device="cpu", overlap_schedule="yes")
    assert Engine(path, device="cpu").config.overlap_schedule is False  # the forward runs on the host thread
    assert Engine(path, device="cpu", overlap_schedule=True).config.overlap_schedule is True
    if torch.cuda.is_available():
        assert Engine(path, device="cuda", num_kvcache_blocks=64).config.overlap_schedule is True


@pytest.mark.parametrize("overlap", [False, True])
def test_non_incremental_requests_report_only_their_finished_output(path, overlap):
    """A request added with incremental=False appears in step() outputs once, finished, with the same tokens, text
    and finish reason (stop tokens and stop strings included) as the same request reported after every token."""
    prompts, params = requests()
    reference = run(path, overlap, prompts, params)
    engine = Engine(path, device="cpu", overlap_schedule=overlap)
    rids = [engine.add_request(p, q, incremental=i % 2 == 0) for i, (p, q) in enumerate(zip(prompts, params))]
    reports = {rid: [] for rid in rids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reports[output.rid].append(output)
    for i, (rid, expected) in enumerate(zip(rids, reference)):
        assert reports[rid][-1].finished and not any(o.finished for o in reports[rid][:-1])
        assert len(reports[rid]) == (len(expected["output_ids"]) if i % 2 == 0 else 1)
        assert_same([reports[rid][-1].to_dict()], [expected])


def test_overlapped_prefill_with_rows_left_out_by_the_budget(path):
    """A 4-token budget below the number of running sequences: steps leave running sequences out, and stop tokens
    finish sequences of the step in flight; the step after is scheduled ahead only when its batch is exactly the
    running set (a finished sequence in it would write to freed blocks). Same tokens as the plain loop."""
    prompts, params = chunked_requests(8)
    budget = dict(max_num_batched_tokens=4)
    count = {"ahead": 0}
    assert_same(run(path, True, prompts, params, count, **budget), run(path, False, prompts, params, **budget))
    assert count["prefill_ahead"] >= 5 and count["declined"] >= 5


def test_every_chunk_of_a_w1_shaped_prefill_is_scheduled_ahead(path):
    """W1's shape scaled down (all requests at once, every prompt the same length, a budget of several whole
    prompts, decode rows of earlier chunks taking budget too): each step while requests wait is scheduled ahead,
    so the GPU never waits for the host between two prefill chunks (an H200 profile of W1 found it ~40% idle
    there; the cause must be on the launch side, not a declining scheduler)."""
    engine = Engine(path, device="cpu", overlap_schedule=True, max_num_batched_tokens=256, max_num_seqs=64)
    vocab = engine.model_runner.model.config.vocab_size
    for i in range(64):
        engine.add_request([5 + (7 * i + j) % (vocab - 5) for j in range(64)],
                           {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": i})
    scheduler, declined, ahead = engine.scheduler, [], []
    original = scheduler.schedule_ahead

    def counting(batch):
        waiting = len(scheduler.waiting)
        result = original(batch)
        (ahead if result else declined).append(waiting)
        return result

    scheduler.schedule_ahead = counting
    while engine.has_unfinished_requests():
        engine.step()
    assert len(ahead) >= 15 and not [waiting for waiting in declined if waiting]  # 4,096 prompt tokens / 256


def test_schedule_ahead_declines_a_batch_that_is_not_the_running_set(path):
    """A batch holding a sequence the previous step finished, beside a running one it left out (so the counts
    match), is not continued: continuing it would grow the finished sequence's freed block table."""
    engine = Engine(path, device="cpu")
    prompts, params = chunked_requests(4)
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    scheduler = engine.scheduler
    batch = scheduler.schedule()
    assert len(batch) == len(scheduler.running) == 4
    scheduler.finish(batch[1].seq, {"type": "abort"})  # finished under the batch; batch[0] "sat out"
    num_free = scheduler.block_manager.num_free_blocks
    assert scheduler.schedule_ahead(batch[1:]) is None
    assert scheduler.block_manager.num_free_blocks == num_free and not batch[1].seq.has_placeholder
    assert scheduler.schedule_ahead(batch) is None  # the counts differ
    assert scheduler.schedule_ahead(batch[:1] + batch[2:]) is not None  # exactly the running set


@pytest.mark.parametrize("ahead_kind", ["decode", "prefill"])
def test_a_failed_launch_ahead_completes_the_step_in_flight_and_flushes_the_prefix_cache(path, ahead_kind):
    """A launch of the step scheduled ahead that raises (e.g. out of memory) leaves no placeholder token behind (the
    step in flight is completed) and no prefix-cache entry for blocks the failed step never wrote; after the error
    the engine aborts cleanly and then answers as a fresh engine does."""
    prompts, params = chunked_requests(4) if ahead_kind == "prefill" else requests(4)
    budget = dict(max_num_batched_tokens=16) if ahead_kind == "prefill" else {}
    engine = Engine(path, device="cpu", overlap_schedule=True, **budget)
    scheduler, runner = engine.scheduler, engine.model_runner
    scheduled_ahead = scheduler.schedule_ahead if ahead_kind == "prefill" else scheduler.look_ahead
    launch, armed = runner.launch, {"fail": False}

    def arming(batch):  # the launch right after a successful scheduling ahead fails
        ahead = scheduled_ahead(batch)
        armed["fail"] = bool(ahead)
        return ahead

    def failing_launch(*args, **kwargs):
        if armed["fail"]:
            raise torch.cuda.OutOfMemoryError("simulated")
        return launch(*args, **kwargs)

    setattr(scheduler, "schedule_ahead" if ahead_kind == "prefill" else "look_ahead", arming)
    runner.launch = failing_launch
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        while engine.has_unfinished_requests():
            engine.step()
    sequences = list(engine.requests.values())
    assert sequences and not any(seq.has_placeholder or PLACEHOLDER in seq.token_ids for seq in sequences)
    assert not engine.block_manager.hash_to_block_id
    engine.abort_all()
    runner.launch = launch
    setattr(scheduler, "schedule_ahead" if ahead_kind == "prefill" else "look_ahead", scheduled_ahead)
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    fresh = Engine(path, device="cpu", overlap_schedule=True, **budget)
    answers = [engine.generate(prompts, greedy), fresh.generate(prompts, greedy)]
    for key in ("output_ids", "output_log_probs", "finish_reason", "text"):
        assert [o[key] for o in answers[0]] == [o[key] for o in answers[1]], key
