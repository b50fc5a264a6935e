"""EngineLoop (the server's driver thread) against a fake engine: every engine call happens on the driver thread,
outputs reach the right awaiting request, abort returns partial output, holds stop stepping, a failing step fails
only the requests in flight, and a consumer that goes away aborts its request."""

import asyncio
import threading
from dataclasses import dataclass

import pytest

from slime.engine.server.engine_loop import EngineLoop
from slime.engine.server.protocol import RequestError


@dataclass
class FakeOutput:
    rid: str
    prompt_token_ids: list
    output_token_ids: list
    output_log_probs: list
    text: str
    finished: bool
    finish_reason: dict | None
    num_cached_tokens: int = 0
    weight_version: str = "0"


class FakeEngine:
    """Emits token `len(prompt) + i` at step i; finishes after `max_new_tokens`. Records the calling threads."""

    def __init__(self):
        self.requests = {}
        self.calling_threads = set()
        self.num_steps = 0
        self.num_launched_steps = 0
        self.fail_next_step = False
        self.weight_version = "0"

    def _record(self):
        self.calling_threads.add(threading.current_thread().name)

    def add_request(self, prompt, params, rid, incremental=True, return_routed_experts=False,
                    lora_name=None, images=None):  # reports every step
        self._record()
        if rid in self.requests:
            raise ValueError(f"rid {rid!r} is already in use")
        self.requests[rid] = (list(prompt), params["max_new_tokens"], [])

    def has_unfinished_requests(self):
        self._record()
        return bool(self.requests)

    def _output(self, rid, finish_reason):
        prompt, _, tokens = self.requests[rid]
        return FakeOutput(rid, prompt, list(tokens), [-0.5] * len(tokens), "x" * len(tokens),
                          finish_reason is not None, finish_reason)

    def step(self):
        self._record()
        self.num_steps += 1
        self.num_launched_steps += bool(self.requests)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outputs = []
        for rid in list(self.requests):
            prompt, max_new_tokens, tokens = self.requests[rid]
            tokens.append(len(prompt) + len(tokens))
            done = len(tokens) >= max_new_tokens
            outputs.append(self._output(rid, {"type": "length", "length": max_new_tokens} if done else None))
            if done:
                del self.requests[rid]
        return outputs

    def abort_request(self, rid):
        self._record()
        if rid not in self.requests:
            return None
        output = self._output(rid, {"type": "abort"})
        del self.requests[rid]
        return output

    def abort_all(self):
        return [self.abort_request(rid) for rid in list(self.requests)]


@pytest.fixture
def engine_loop():
    loop = EngineLoop(FakeEngine())
    loop.start()
    yield loop
    loop.stop()


async def collect(engine_loop, prompt, max_new_tokens, rid=None):
    return [o async for o in engine_loop.generate(prompt, {"max_new_tokens": max_new_tokens}, rid)]


def test_concurrent_requests_get_their_own_outputs_from_the_driver_thread(engine_loop):
    async def main():
        return await asyncio.gather(*(collect(engine_loop, [0] * n, n + 1) for n in range(1, 6)))

    results = asyncio.run(main())
    for n, outputs in zip(range(1, 6), results):
        assert len(outputs) == n + 1 and outputs[-1].finished
        assert outputs[-1].output_token_ids == list(range(n, 2 * n + 1))
    assert engine_loop.engine.calling_threads == {"slime-engine-loop"}


def test_abort_returns_partial_output_and_hold_stops_stepping(engine_loop):
    async def main():
        generator = engine_loop.generate([1, 2], {"max_new_tokens": 10_000}, "long")
        first = await generator.__anext__()
        await asyncio.wrap_future(engine_loop.set_hold("paused", True))
        steps = engine_loop.engine.num_steps
        await asyncio.sleep(0.2)
        assert engine_loop.engine.num_steps == steps  # held: no step
        assert await asyncio.wrap_future(engine_loop.abort("long")) is True
        rest = [o async for o in generator]
        await asyncio.wrap_future(engine_loop.set_hold("paused", False))
        return first, rest

    first, rest = asyncio.run(main())
    final = rest[-1]
    assert final.finished and final.finish_reason == {"type": "abort"}
    assert len(final.output_token_ids) >= len(first.output_token_ids) >= 1
    assert engine_loop.num_in_flight == 0


def test_failed_step_fails_in_flight_requests_and_loop_keeps_serving(engine_loop):
    engine_loop.engine.fail_next_step = True

    async def main():
        with pytest.raises(RuntimeError, match="boom"):
            await collect(engine_loop, [1], 3)
        return await collect(engine_loop, [1], 3)

    assert asyncio.run(main())[-1].finished
    assert engine_loop.is_alive and "boom" in engine_loop.last_step_error


def test_duplicate_rid_is_a_request_error(engine_loop):
    async def main():
        generator = engine_loop.generate([1], {"max_new_tokens": 10_000}, "same")
        await generator.__anext__()
        with pytest.raises(RequestError, match="already"):
            await collect(engine_loop, [1], 2, "same")
        await generator.aclose()  # the consumer going away aborts its request
        for _ in range(100):
            if not engine_loop.engine.requests:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine_loop.engine.requests == {} and engine_loop.num_in_flight == 0


def test_non_incremental_consumer_gets_only_the_finished_output_and_abort_keeps_partials(engine_loop):
    async def main():
        finals = await asyncio.gather(*(
            asyncio.create_task(_all(engine_loop.generate([0] * n, {"max_new_tokens": n + 2}, incremental=False)))
            for n in range(1, 4)
        ))
        generator = engine_loop.generate([1, 2], {"max_new_tokens": 10_000}, "long", incremental=False)
        waiter = asyncio.create_task(_all(generator))
        while engine_loop.engine.num_steps < 5 or "long" not in engine_loop.engine.requests:
            await asyncio.sleep(0.01)
        assert await asyncio.wrap_future(engine_loop.abort("long")) is True
        return finals, await waiter

    finals, aborted = asyncio.run(main())
    for n, outputs in zip(range(1, 4), finals):
        assert len(outputs) == 1 and outputs[0].finished
        assert outputs[0].output_token_ids == list(range(n, 2 * n + 2))
    assert len(aborted) == 1 and aborted[0].finish_reason == {"type": "abort"}
    assert len(aborted[0].output_token_ids) >= 1
    assert engine_loop.num_in_flight == 0


async def _all(generator):
    return [output async for output in generator]


def test_a_request_that_reports_only_its_end_never_makes_the_loop_back_off(tiny_qwen3):
    """The real engine: a non-incremental request's steps return no outputs until it finishes, but they launch
    batches, so the driver must keep stepping instead of sleeping IDLE_WAIT_S per step (a 256-token rollout sample
    took 12 s instead of 0.8 s on an H200 that way)."""
    from slime.engine.engine import Engine
    from slime.engine.server.engine_loop import IDLE_WAIT_S, MAX_EMPTY_STEPS_BEFORE_BACKOFF

    loop = EngineLoop(Engine(str(tiny_qwen3), device="cpu"))
    backoffs = []
    wait = loop._wake.wait

    def counting_wait(timeout=None):
        if loop.num_in_flight and timeout == IDLE_WAIT_S:
            backoffs.append(timeout)
        return wait(timeout)

    loop._wake.wait = counting_wait
    num_tokens = 2 * MAX_EMPTY_STEPS_BEFORE_BACKOFF

    async def main():
        params = {"max_new_tokens": num_tokens, "ignore_eos": True}
        return [output async for output in loop.generate([5, 6, 7], params, incremental=False)]

    loop.start()
    try:
        outputs = asyncio.run(main())
    finally:
        loop.stop()
    assert len(outputs) == 1 and outputs[0].num_completion_tokens == num_tokens
    assert backoffs == []


def test_a_busy_period_counts_its_steps_requests_and_tokens(engine_loop, caplog):
    async def main():  # held while the five requests are added, so they all run in one busy period
        await asyncio.wrap_future(engine_loop.set_hold("paused", True))
        tasks = [asyncio.create_task(collect(engine_loop, [0] * n, n + 1)) for n in range(1, 6)]
        while engine_loop.num_in_flight < 5:
            await asyncio.sleep(0.01)
        await asyncio.wrap_future(engine_loop.set_hold("paused", False))
        return await asyncio.gather(*tasks)

    with caplog.at_level("INFO", logger="slime.engine.server.busy_period"):
        asyncio.run(main())
        for _ in range(100):  # the period ends at the driver's next idle wait
            if engine_loop.busy.last is not None and not engine_loop.busy.active:
                break
            threading.Event().wait(0.02)
    period = engine_loop.busy.last
    assert period["finished_requests"] == 5 and period["output_tokens"] == sum(n + 1 for n in range(1, 6))
    assert period["steps"] >= 6 and 0 < period["step_seconds"] <= period["seconds"]
    assert period["graph_captures"] == 0  # the fake engine has no model runner, so no graphs
    assert any("engine busy" in r.getMessage() and "5 requests finished, 20 output tokens" in r.getMessage()
               for r in caplog.records)
