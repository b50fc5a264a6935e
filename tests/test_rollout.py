"""The default rollout against the REAL sglang-router, with a scripted SGLang-compatible worker behind it.

The scripted worker makes timing deterministic (which groups are still generating when the rollout aborts), so
partial rollout, over-sampling and the dynamic filter can be checked exactly. test_rollout_engine.py runs the
same path against the built-in engine server.
"""

import asyncio
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from slime.rollout import http_client
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.dataset import load_tokenizer
from slime.rollout.eval import compute_pass_at_k
from slime.rollout.sglang_rollout import generate, generate_rollout, get_last_rollout_metrics
from slime.utils.misc import find_free_port
from slime.utils.types import Sample

MAX_RESPONSE_LEN = 6


# ---------------------------------------------------------------- router helpers (also used by test_rollout_engine)
def launch_router(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--policy", "round_robin", "--log-level", "warn", "--prometheus-port", str(find_free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/workers", timeout=1, trust_env=False)
            return proc
        except httpx.TransportError:
            assert proc.poll() is None, "sglang-router exited during startup"
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("sglang-router did not start in 30 s")


def register_worker(router_port: int, worker_url: str, timeout_s: float = 60) -> None:
    base = f"http://127.0.0.1:{router_port}"
    response = httpx.post(f"{base}/workers", json={"url": worker_url}, timeout=5, trust_env=False)
    assert response.status_code in (200, 202), response.text
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        workers = httpx.get(f"{base}/workers", timeout=5, trust_env=False).json()["workers"]
        if any(w["url"] == worker_url and w.get("is_healthy", True) for w in workers):
            return
        time.sleep(0.2)
    raise RuntimeError(f"router did not list worker {worker_url} within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---------------------------------------------------------------- the scripted worker
def scripted_token(position: int) -> int:
    """Token at absolute sequence position: a continued request yields the same tokens as an uninterrupted one."""
    return 3 + position % 50


def scripted_log_prob(position: int) -> float:
    return -0.01 * (position % 10) - 0.01


class ScriptedWorker:
    """SGLang's /generate: max_new_tokens tokens (finish "length"); prompts in `slow_prompts` emit one token and
    then wait `slow_delay_s` per token; /abort_request {"abort_all": true} ends every in-flight request with "abort"."""

    def __init__(self):
        self.slow_prompts: set[tuple] = set()
        self.slow_delay_s = 30.0
        self.requests: list[dict] = []
        self.num_abort_calls = 0
        self._abort_event: asyncio.Event | None = None
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _serve(self, started):
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_route("GET", "/{tail:.*}", self._info)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._abort_event = asyncio.Event()
        started.set()
        self._loop.run_forever()

    async def _info(self, request):
        from aiohttp import web

        return web.json_response({"model_path": "scripted", "is_generation": True, "status": "ok"})

    async def _abort(self, request):
        from aiohttp import web

        assert (await request.json()) == {"abort_all": True}
        self.num_abort_calls += 1
        self._abort_event.set()
        self._abort_event = asyncio.Event()
        return web.json_response({})

    async def _generate(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        input_ids = body["input_ids"]
        abort_event = self._abort_event
        slow = tuple(input_ids[: self._prompt_len(input_ids)]) in self.slow_prompts
        output, finish = [], "length"
        for k in range(body["sampling_params"]["max_new_tokens"]):
            if abort_event.is_set():
                finish = "abort"
                break
            output.append(len(input_ids) + k)
            if slow:
                try:
                    await asyncio.wait_for(abort_event.wait(), self.slow_delay_s)
                except asyncio.TimeoutError:
                    pass
        tokens = [scripted_token(p) for p in output]
        return web.json_response({
            "text": "".join(f"<{t}>" for t in tokens),
            "output_ids": tokens,
            "meta_info": {
                "finish_reason": {"type": finish},
                "output_token_logprobs": [[scripted_log_prob(p), scripted_token(p), None] for p in output],
                "weight_version": "7",
                "prompt_tokens": len(input_ids),
                "cached_tokens": 1,
                "completion_tokens": len(tokens),
            },
        })

    def _prompt_len(self, input_ids):
        for prompt in self.slow_prompts:
            if tuple(input_ids[: len(prompt)]) == prompt:
                return len(prompt)
        return len(input_ids)


# ---------------------------------------------------------------- test hooks (loaded by dotted path)
async def reward_by_index(args, sample):
    """Even groups all get 1.0 (zero std); odd groups get 0/1 by sample index."""
    return 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)


async def reward_per_group(args, samples):
    return [10.0 * samples[0].group_index + i for i in range(len(samples))]


async def failing_reward(args, sample):
    if sample.index % 2:
        raise RuntimeError("grader crashed")
    return 1.0


def keep_odd_groups(args, group):
    return group[0].group_index % 2 == 1


async def generate_with_tool_output(args, sample, sampling_params):
    sample = await generate(args, sample, sampling_params)
    sample.append_response_tokens([11, 12], trainable=False, text="<tool>")
    return sample


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("rollout_tok")
    build_tokenizer(out)
    return str(out)


@pytest.fixture(scope="module")
def worker():
    return ScriptedWorker()


@pytest.fixture(scope="module")
def router_port(worker):
    port = find_free_port()
    proc = launch_router(port)
    try:
        register_worker(port, worker.url)
        yield port
    finally:
        stop(proc)


@pytest.fixture
def make_args(tmp_path, tokenizer_dir, router_port, worker):
    worker.requests.clear()
    worker.slow_prompts.clear()

    def make(prompts, **overrides):
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in prompts))
        args = SimpleNamespace(
            prompt_data=str(path), input_key="input", label_key="label", metadata_key="metadata", tool_key="tools",
            apply_chat_template=False, rollout_max_prompt_len=None, hf_checkpoint=tokenizer_dir,
            n_samples_per_prompt=2, rollout_shuffle=False, rollout_seed=42, buffer_filter_path=None,
            rollout_batch_size=2, over_sampling_batch_size=None, rollout_temperature=1.0, rollout_top_p=1.0,
            rollout_top_k=-1, rollout_max_response_len=MAX_RESPONSE_LEN, rollout_stop=None,
            rollout_stop_token_ids=None, rollout_skip_special_tokens=False, sglang_router_ip="127.0.0.1",
            sglang_router_port=router_port, sglang_server_concurrency=8, rollout_num_engines=1,
            custom_rm_path=f"{__name__}.reward_by_index", rm_type=None, group_rm=False, reward_key=None,
            dynamic_sampling_filter_path=None, partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
            custom_generate_function_path=None,
        )
        args.__dict__.update(overrides)
        return args

    return make


def prompt_ids(tokenizer_dir, text):
    return load_tokenizer(tokenizer_dir)(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- tests
def test_samples_are_filled_from_the_engine_answer(make_args, tokenizer_dir, worker):
    args = make_args(["1 + 1", "2 + 2", "3 + 3"])
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    for group in groups:
        for sample in group:
            ids = prompt_ids(tokenizer_dir, sample.prompt)
            positions = range(len(ids), len(ids) + MAX_RESPONSE_LEN)
            assert sample.tokens == ids + [scripted_token(p) for p in positions]
            assert sample.response_length == MAX_RESPONSE_LEN == len(sample.loss_mask) == len(sample.rollout_log_probs)
            assert sample.rollout_log_probs == pytest.approx([scripted_log_prob(p) for p in positions])
            assert sample.loss_mask == [1] * MAX_RESPONSE_LEN
            assert sample.status == Sample.Status.TRUNCATED and sample.weight_versions == ["7"]
            assert sample.reward == float(sample.index % 2) if sample.group_index % 2 else 1.0
            assert sample.response.startswith("<")
    sent = worker.requests[0]
    assert sent["return_logprob"] is True
    assert sent["sampling_params"] == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_RESPONSE_LEN,
        "skip_special_tokens": False, "no_stop_trim": True,
    }
    metrics = get_last_rollout_metrics()
    assert metrics["rollout/num_groups_fetched"] == 2 and metrics["rollout/num_groups_aborted"] == 0
    assert metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(
        4 / sum(len(prompt_ids(tokenizer_dir, p)) for p in ["1 + 1", "1 + 1", "2 + 2", "2 + 2"])
    )


@pytest.mark.parametrize(
    "filter_path",
    [f"{__name__}.keep_odd_groups", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"],
)
def test_dynamic_filter_drops_and_over_samples(make_args, filter_path):
    args = make_args([f"{i} + 1" for i in range(8)], dynamic_sampling_filter_path=filter_path)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [g[0].group_index for g in groups] == [1, 3]
    assert all(sorted(s.reward for s in g) == [0.0, 1.0] for g in groups)
    metrics = get_last_rollout_metrics()
    assert metrics["rollout/num_groups_fetched"] == 4  # two waves of over-sampling
    assert metrics["rollout/dynamic_filter/num_dropped"] >= 1
    drop_keys = [k for k in metrics if k.startswith("rollout/dynamic_filter/drop_")]
    assert drop_keys and sum(metrics[k] for k in drop_keys) == metrics["rollout/dynamic_filter/num_dropped"]


def test_keep_when_insufficient_keeps_a_dropped_group_without_spares(make_args):
    filter_path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    args = make_args([f"{i} + 1" for i in range(8)], dynamic_sampling_filter_path=filter_path)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [g[0].group_index for g in groups] == [0, 1]  # group 0 has zero std but nothing could replace it
    metrics = get_last_rollout_metrics()
    assert metrics["rollout/dynamic_filter/num_kept_when_insufficient"] == 1
    assert metrics["rollout/dynamic_filter/num_dropped"] == 0 and metrics["rollout/num_groups_fetched"] == 2

    args.over_sampling_batch_size = 4  # spares in flight: the zero-std groups are dropped after all
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [g[0].group_index for g in groups] == [1, 3]
    assert get_last_rollout_metrics()["rollout/dynamic_filter/num_kept_when_insufficient"] == 0


@pytest.mark.parametrize("partial", [True, False])
def test_abort_returns_partial_groups_and_continues_them(make_args, tokenizer_dir, worker, partial):
    prompts = ["9 + 9", "slow 1", "slow 2"]
    args = make_args(
        prompts, rollout_batch_size=1, over_sampling_batch_size=3, partial_rollout=partial,
        mask_offpolicy_in_partial_rollout=True,
    )
    worker.slow_prompts = {tuple(prompt_ids(tokenizer_dir, p)) for p in prompts[1:]}
    source = RolloutDataSourceWithBuffer(args)
    num_aborts_before = worker.num_abort_calls
    groups = generate_rollout(args, 5, source)
    assert [g[0].prompt for g in groups] == ["9 + 9"]
    assert worker.num_abort_calls == num_aborts_before + 1
    metrics = get_last_rollout_metrics()
    assert metrics["rollout/num_groups_aborted"] == 2
    if not partial:
        assert source.buffer == [] and metrics["rollout/num_groups_returned_to_buffer"] == 0
        return
    assert metrics["rollout/num_groups_returned_to_buffer"] == 2
    buffered = [s for g in source.buffer for s in g]
    assert [s.prompt for s in buffered] == ["slow 1", "slow 1", "slow 2", "slow 2"]
    for sample in buffered:
        assert sample.status == Sample.Status.ABORTED and sample.reward is None
        assert sample.response_length == 1 and sample.metadata["start_rollout_id"] == 5

    # next rollout: the buffered groups come first and are continued where they stopped
    worker.slow_prompts = set()
    worker.requests.clear()
    args.rollout_batch_size, args.over_sampling_batch_size = 2, 2
    groups = generate_rollout(args, 6, source)
    assert [g[0].prompt for g in groups] == ["slow 1", "slow 2"] and source.buffer == []
    assert sorted(r["sampling_params"]["max_new_tokens"] for r in worker.requests) == [MAX_RESPONSE_LEN - 1] * 4
    for sample in (s for g in groups for s in g):
        ids = prompt_ids(tokenizer_dir, sample.prompt)
        positions = range(len(ids), len(ids) + MAX_RESPONSE_LEN)
        assert sample.tokens == ids + [scripted_token(p) for p in positions]
        assert sample.loss_mask == [0] + [1] * (MAX_RESPONSE_LEN - 1)  # the off-policy prefix is masked
        assert sample.rollout_log_probs == pytest.approx([scripted_log_prob(p) for p in positions])
        assert sample.status == Sample.Status.TRUNCATED and sample.reward is not None
        assert sample.metadata["start_rollout_id"] == 5


def test_custom_generate_hook(make_args):
    args = make_args(["1 + 2"], rollout_batch_size=1,
                     custom_generate_function_path=f"{__name__}.generate_with_tool_output")
    (group,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    for sample in group:
        assert sample.response_length == MAX_RESPONSE_LEN + 2
        assert sample.loss_mask == [1] * MAX_RESPONSE_LEN + [0, 0]
        assert sample.rollout_log_probs[-2:] == [0.0, 0.0] and sample.tokens[-2:] == [11, 12]


def test_group_rm_and_reward_failures(make_args):
    args = make_args(["1 + 2", "3 + 4"], group_rm=True, custom_rm_path=f"{__name__}.reward_per_group")
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[s.reward for s in g] for g in groups] == [[0.0, 1.0], [10.0, 11.0]]
    assert get_last_rollout_metrics()["rollout/reward_failures"] == 0

    args = make_args(["1 + 2", "3 + 4"], custom_rm_path=f"{__name__}.failing_reward")
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[s.reward for s in g] for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert "grader crashed" in groups[0][1].metadata["reward_error"]
    assert get_last_rollout_metrics()["rollout/reward_failures"] == 2


def test_exhausted_data_source_is_an_error_not_a_hang(make_args):
    class TwoGroupsOnly(RolloutDataSourceWithBuffer):
        def get_samples(self, num_groups):
            return super().get_samples(num_groups) if self.sample_group_index < 2 else []

    args = make_args(["1 + 2", "3 + 4"], dynamic_sampling_filter_path=f"{__name__}.keep_odd_groups")
    with pytest.raises(RuntimeError, match="ran out of prompt groups with 1 of 2 accepted"):
        generate_rollout(args, 0, TwoGroupsOnly(args))


def test_unreachable_router_gives_a_clear_error(make_args, monkeypatch):
    monkeypatch.setattr(http_client, "DEFAULT_NUM_RETRIES", 2)
    port = find_free_port()
    args = make_args(["1 + 2"], rollout_batch_size=1, sglang_router_port=port)
    with pytest.raises(http_client.EndpointUnreachableError, match=rf"http://127\.0\.0\.1:{port}/generate"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


def test_eval_uses_eval_params_and_returns_per_dataset_results(make_args, tmp_path, worker):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({"input": "1 + 1"}) + "\n")
    second.write_text("".join(json.dumps({"input": f"{i} + 2"}) + "\n" for i in range(2)))
    args = make_args(
        ["unused"], eval_prompt_data=["a", str(first), "b", str(second)], n_samples_per_eval_prompt=3,
        eval_temperature=0.5, eval_max_response_len=2, eval_top_p=None, eval_top_k=None,
    )
    results = generate_rollout(args, 0, None, evaluation=True)
    assert sorted(results) == ["a", "b"]
    assert len(results["a"]["rewards"]) == 3 and len(results["b"]["samples"]) == 6
    assert [s.group_index for s in results["b"]["samples"]] == [0, 0, 0, 1, 1, 1]
    assert results["b"]["truncated"] == [True] * 6
    assert all(s.response_length == 2 for s in results["b"]["samples"])
    assert {r["sampling_params"]["temperature"] for r in worker.requests} == {0.5}
    assert results["b"]["rewards"] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # reward_by_index on eval indices


def test_pass_at_k_matches_the_combinatorial_definition():
    import itertools

    rewards = [[1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    for k in (1, 2, 3, 5):
        brute = sum(
            sum(any(r[i] > 0 for i in subset) for subset in itertools.combinations(range(5), k))
            / len(list(itertools.combinations(range(5), k)))
            for r in rewards
        ) / len(rewards)
        assert compute_pass_at_k(rewards, k) == pytest.approx(brute)
    assert compute_pass_at_k(rewards, 1) == pytest.approx((0.4 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="pass@6"):
        compute_pass_at_k(rewards, 6)
