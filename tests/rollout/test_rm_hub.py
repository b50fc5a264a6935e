"""Reward functions: real math-verify grading, every rm type, dispatch order, failure handling, remote_rm over HTTP."""

import asyncio
import os
import sys
import textwrap
import time

import pytest
from aiohttp import web

from slime.rollout import rm_hub
from slime.rollout.rm_hub import remote_rm as remote_rm_module
from slime.rollout.rm_hub.answer_parsing import last_boxed_content, normalize_final_answer
from slime.rollout.rm_hub.f1 import f1_score
from slime.rollout.rm_hub.gpqa import DEFAULT_VALID_LETTERS, _extract_letter_from_response
from slime.utils.misc import find_free_port
from slime.utils.types import Sample
from tests.helpers import args_helpers


def make_args(**overrides):
    return args_helpers.make_args(**{"rm_type": None, **overrides})


def reward(rm_type, response, label, **sample_fields):
    sample = Sample(response=response, label=label, **sample_fields)
    return asyncio.run(rm_hub.async_rm(make_args(rm_type=rm_type), sample))


# ---------------------------------------------------------------------------------------------- answer parsing


def test_last_boxed_content():
    assert last_boxed_content(r"a \boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert last_boxed_content(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed_content(r"$\boxed 7$") == "7"
    assert last_boxed_content(r"so \boxed $ x = 3$") is None and last_boxed_content("\\boxed  ") is None
    assert last_boxed_content(r"cut off \boxed{\frac{1}{") is None
    assert last_boxed_content("no box") is None


@pytest.mark.parametrize(
    "raw,expected",
    [("x = 5", "5"), (r"\text{10 cents}", "10"), ("1,000", "1000"), (r"\dfrac12", r"\frac{1}{2}"),
     (r"\left( 1, 2 \right)", "(1,2)"), (r"90^\circ", "90"), (r"\sqrt2", r"\sqrt{2}"), ("$19$.", "19")],
)
def test_normalize_final_answer(raw, expected):
    assert normalize_final_answer(raw) == expected


# ---------------------------------------------------------------------------------------------- math rewards


@pytest.mark.parametrize(
    "response,label,expected",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{19}", "19", 1.0),
        (r"\boxed{19}", 19, 1.0),
        (r"\boxed{20}", "19", 0.0),
        (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        (r"\boxed{\{1,2\}}", r"\{1, 2\}", 1.0),
        (r"\boxed{19}", r"\boxed{19}", 1.0),
        ("19", "19", 0.0),  # no boxed answer
        (r"\boxed{}", "19", 0.0),
    ],
)
def test_math_reward_grades_with_math_verify(response, label, expected):
    assert reward("math", response, label) == expected


def test_deepscaler_takes_answer_after_thinking():
    assert reward("deepscaler", r"<think>maybe \boxed{3}</think> It is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert reward("deepscaler", r"<think>it is \boxed{19}</think> hmm", "19") == 0.0  # box only inside thinking
    assert reward("deepscaler", r"<think>never finished \boxed{19}", "19") == 0.0
    assert reward("deepscaler", r"###Response \boxed{19}", "19") == 1.0


def test_dapo_reward():
    assert reward("dapo", "work...\nAnswer: 19", "19") == {"score": 1.0, "acc": True, "pred": "19"}
    assert reward("dapo", "Answer: 18", "19") == {"score": -1.0, "acc": False, "pred": "18"}
    assert reward("dapo", r"no answer line but \boxed{19}", "19")["acc"] is True
    assert reward("dapo", "Answer: 19\n" + "x" * 300, "19")["pred"] == "[INVALID]"  # outside the last 300 chars


def test_boxed_prefix_extracts_first():
    assert reward("boxed_f1", r"long text, final: \boxed{Paris}", "paris") == 1.0
    assert reward("boxed_f1", "Paris without a box", "paris") == 0.0


# --------------------------------------------------------------------------------------------- other rm types


def test_f1_reward():
    assert f1_score("the cat sat", "cat sat down") == pytest.approx((0.8, 1.0, 2 / 3))  # slime's (f1, p, r)
    assert f1_score("Yes.", "yes")[0] == 1.0 and f1_score("yes it is", "yes") == (0, 0, 0)
    assert reward("f1", "<think>no idea</think>The Eiffel Tower", ["eiffel tower", "tour eiffel"]) == 1.0
    assert reward("f1", "London", "Paris") == 0.0


def test_gpqa_reward():
    assert reward("gpqa", "Reasoning... Answer: (C)", "C") == 1.0
    assert reward("gpqa", r"\boxed{B}", "7 eV", metadata={"choices": ["1 eV", "7 eV", "9 eV"]}) == 1.0
    assert reward("gpqa", "<think>A looks right</think>The answer is D", "D") == 1.0
    assert reward("gpqa", "The answer is (A)", "B") == 0.0
    assert _extract_letter_from_response("I think it is\nB.\n", DEFAULT_VALID_LETTERS) == "B"  # slime's scorer
    assert _extract_letter_from_response("nothing here", DEFAULT_VALID_LETTERS) is None


def test_random_reward_and_type_validation():
    assert reward("random", "", None) in (0.0, 1.0)
    with pytest.raises(ValueError, match="math, deepscaler, dapo, f1, gpqa, remote_rm, random"):
        reward("nope", "", None)
    with pytest.raises(ValueError, match="no reward configured"):
        reward(None, "", None)
    with pytest.raises(ValueError, match="needs --rm-url"):
        reward("remote_rm", "", None)


def test_metadata_rm_type_overrides_flag():
    sample = Sample(response="Answer: 19", label="19", metadata={"rm_type": "dapo"})
    assert asyncio.run(rm_hub.async_rm(make_args(rm_type="math"), sample))["acc"] is True


# ------------------------------------------------------------------------------------- custom rewards, failures

CUSTOM_RM_SOURCE = """
import asyncio
import os
import time

async def length_rm(args, sample):
    return float(len(sample.response))

async def constant_rm(args, sample):
    return 42.0

def sync_rm(args, sample):
    return 7.0

async def raising_rm(args, sample):
    raise RuntimeError("grader crashed")

async def hanging_rm(args, sample):
    await asyncio.sleep(60)

def sync_hanging_rm(args, sample):
    time.sleep(2)
    return 1.0

async def group_rm(args, samples):
    best = max(len(s.response) for s in samples)
    return [1.0 if len(s.response) == best else 0.0 for s in samples]

async def short_group_rm(args, samples):
    return [1.0]

async def hanging_group_rm(args, samples):
    await asyncio.sleep(60)
"""


@pytest.fixture(scope="module")
def custom_rm(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom_rm")
    (path / "slime_test_custom_rm.py").write_text(textwrap.dedent(CUSTOM_RM_SOURCE))
    sys.path.insert(0, str(path))
    yield "slime_test_custom_rm"
    sys.path.remove(str(path))
    sys.modules.pop("slime_test_custom_rm", None)


def test_custom_rm_priority(custom_rm):
    args = make_args(rm_type="math", custom_rm_path=f"{custom_rm}.length_rm")
    assert asyncio.run(rm_hub.async_rm(args, Sample(response="abc"))) == 3.0
    per_sample = Sample(response="abc", custom_rm_path=f"{custom_rm}.constant_rm")
    assert asyncio.run(rm_hub.async_rm(args, per_sample)) == 42.0
    assert asyncio.run(rm_hub.async_rm(make_args(custom_rm_path=f"{custom_rm}.sync_rm"), Sample())) == 7.0
    with pytest.raises(ValueError, match="--custom-rm-path"):
        asyncio.run(rm_hub.async_rm(make_args(custom_rm_path=f"{custom_rm}.missing"), Sample()))


def test_raising_reward_gives_failure_value_and_records_error(custom_rm):
    sample = Sample(index=3)
    args = make_args(custom_rm_path=f"{custom_rm}.raising_rm", reward_failure_value=-1.0)
    assert asyncio.run(rm_hub.async_rm(args, sample)) == -1.0
    assert sample.metadata["reward_error"] == "RuntimeError: grader crashed"
    assert asyncio.run(rm_hub.async_rm(make_args(custom_rm_path=f"{custom_rm}.constant_rm"), sample)) == 42.0
    assert "reward_error" not in sample.metadata


@pytest.mark.parametrize("fn", ["hanging_rm", "sync_hanging_rm"])
def test_hanging_reward_is_bounded_by_timeout(custom_rm, fn):
    sample = Sample()
    args = make_args(custom_rm_path=f"{custom_rm}.{fn}", reward_timeout=0.2)
    start = time.monotonic()
    assert asyncio.run(rm_hub.async_rm(args, sample)) == 0.0
    assert time.monotonic() - start < 1.5
    assert "TimeoutError" in sample.metadata["reward_error"] and "0.2s" in sample.metadata["reward_error"]


def test_batched_rm_per_sample_and_group(custom_rm):
    samples = [Sample(response=r"\boxed{19}", label="19"), Sample(response=r"\boxed{2}", label="19")]
    assert asyncio.run(rm_hub.batched_async_rm(make_args(rm_type="math"), samples)) == [1.0, 0.0]

    group = [Sample(response="a"), Sample(response="abc"), Sample(response="ab")]
    args = make_args(group_rm=True, custom_rm_path=f"{custom_rm}.group_rm")
    assert asyncio.run(rm_hub.batched_async_rm(args, group)) == [0.0, 1.0, 0.0]

    with pytest.raises(ValueError, match="list of 3 rewards"):
        args = make_args(group_rm=True, custom_rm_path=f"{custom_rm}.short_group_rm")
        asyncio.run(rm_hub.batched_async_rm(args, group))

    args = make_args(group_rm=True, custom_rm_path=f"{custom_rm}.hanging_group_rm", reward_timeout=0.2)
    assert asyncio.run(rm_hub.batched_async_rm(args, group)) == [0.0, 0.0, 0.0]
    assert all("TimeoutError" in s.metadata["reward_error"] for s in group)


# ------------------------------------------------------------------------------------------------------ remote_rm


async def _with_reward_server(handler, body):
    app = web.Application()
    app.router.add_post("/reward", handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0)  # a handler that hangs on purpose must not hold cleanup 60 s
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await body(f"http://127.0.0.1:{port}/reward")
    finally:
        await remote_rm_module.close_remote_rm_session()
        await runner.cleanup()


def test_remote_rm_posts_payload_and_retries(monkeypatch):
    monkeypatch.setattr(remote_rm_module, "BACKOFF_BASE_S", 0.01)
    received = []

    async def handler(request):
        received.append(await request.json())
        if len(received) == 1:
            return web.Response(status=503)  # transient: retried
        return web.json_response({"score": 0.75, "acc": True})

    async def body(url):
        sample = Sample(prompt="1+1?", response="2", label="2")
        return await rm_hub.async_rm(make_args(rm_type="remote_rm", rm_url=url), sample)

    assert asyncio.run(_with_reward_server(handler, body)) == {"score": 0.75, "acc": True}
    assert received == [{"prompt": "1+1?", "response": "2", "label": "2"}] * 2


def test_remote_rm_that_hangs_once_is_retried_within_the_reward_timeout(monkeypatch):
    monkeypatch.setattr(remote_rm_module, "BACKOFF_BASE_S", 0.01)
    num_calls = []

    async def handler(request):
        num_calls.append(1)
        if len(num_calls) == 1:
            await asyncio.sleep(3600)  # the first attempt never answers: cut at half the budget, then retried
        return web.json_response(1.0)

    async def body(url):
        sample = Sample(prompt="1+1?", response="2", label="2")
        reward = await rm_hub.async_rm(make_args(rm_type="remote_rm", rm_url=url, reward_timeout=4.0), sample)
        return reward, sample.metadata.get("reward_error")

    assert asyncio.run(_with_reward_server(handler, body)) == (1.0, None)
    assert len(num_calls) == 2


def test_remote_rm_client_error_is_not_retried(monkeypatch):
    monkeypatch.setattr(remote_rm_module, "BACKOFF_BASE_S", 0.01)
    calls = []

    async def handler(request):
        calls.append(1)
        return web.Response(status=400, text="bad label")

    sample = Sample(label="2")

    async def body(url):
        return await rm_hub.async_rm(make_args(rm_type="remote_rm", rm_url=url), sample)

    assert asyncio.run(_with_reward_server(handler, body)) == 0.0
    assert len(calls) == 1
    assert "400" in sample.metadata["reward_error"] and "bad label" in sample.metadata["reward_error"]


def test_remote_rm_unreachable_fails_after_retries(monkeypatch):
    monkeypatch.setattr(remote_rm_module, "BACKOFF_BASE_S", 0.001)
    sample = Sample()

    async def body():
        args = make_args(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{find_free_port()}/reward")
        try:
            return await rm_hub.async_rm(args, sample)
        finally:
            await remote_rm_module.close_remote_rm_session()

    assert asyncio.run(body()) == 0.0
    assert "ClientConnectorError" in sample.metadata["reward_error"]


# ------------------------------------------------------------------------------------------- math-verify worker pool


def test_math_verify_pool_timeout_and_recovery():
    from concurrent.futures.process import BrokenProcessPool

    from slime.rollout.rm_hub import math_verify_pool

    with pytest.raises(TimeoutError, match="sleep took longer than 0.1s"):
        asyncio.run(math_verify_pool.run_in_pool(time.sleep, 2.0, timeout=0.1, description="sleep"))
    # a worker that dies breaks the pool; the next grading call gets a fresh one
    with pytest.raises(BrokenProcessPool):
        math_verify_pool._get_pool().submit(os._exit, 1).result(timeout=30)
    assert asyncio.run(math_verify_pool.math_equal_in_pool(r"\frac{1}{2}", "0.5")) is True
