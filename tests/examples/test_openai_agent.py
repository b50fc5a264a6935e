"""examples/openai_agent: its generate function against a real engine server and the real sglang-router (the agent's
official `openai` client -> the OpenAIAdapter it starts -> router -> engine), the agent loop and the reward on their
own, and one end-to-end run of the example (SFT warm start, then GRPO through train.py).

The task's tiny model is random before SFT and never writes a tool call, so the tool turn through the real engine
is driven by a scripted agent that answers as if the model had called the tool; the real loop calls the tool in the
end-to-end run.
"""

import asyncio
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from examples.openai_agent import generate as agent_generate
from examples.openai_agent.agent import GET_WEATHER, AgentResult, AgentTurn, ToolError, WeatherService, run_agent
from examples.openai_agent.reward import final_answer_reward, score
from examples.openai_agent.task import CONDITIONS, build_task
from slime.engine.server.launch import launch_server
from slime.ray.router import RouterProcess, register_worker
from slime.rollout.dataset import PromptFormat, load_prompt_samples
from slime.utils.http_utils import run
from slime.utils.types import FINISH_REASON_TO_STATUS, Sample
from tests.helpers import args_helpers

REPO = Path(__file__).resolve().parents[2]
ROUTER_KEY = "router-key"  # the router refuses requests without it: generate must send router_headers(args)
SEED = 4321
SAMPLING = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": SEED, "no_stop_trim": True}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_task(tmp_path_factory.mktemp("openai_agent_task"), num_rows=16)


@pytest.fixture(scope="module")
def router(task, tmp_path_factory):
    server = launch_server(task["model"], log_path=tmp_path_factory.mktemp("log") / "server.log")
    process = RouterProcess(policy="manual", api_key=ROUTER_KEY)
    register_worker(process.url, server.url, api_key=ROUTER_KEY)
    yield process
    process.shutdown()
    server.stop()


@pytest.fixture(scope="module")
def args(task, router):
    host, port = router.url.removeprefix("http://").split(":")
    return args_helpers.make_args(sglang_router_ip=host, sglang_router_port=int(port), sglang_api_key=ROUTER_KEY,
                                  hf_checkpoint=str(task["model"]), max_turns=3)


@pytest.fixture(scope="module")
def tokenizer(task):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(task["model"])


def prompt_samples(task) -> list[Sample]:
    samples, _ = load_prompt_samples(str(task["train"]), PromptFormat(input_key="prompt", label_key="label"))
    for index, sample in enumerate(samples):
        sample.index = sample.group_index = index
    return samples


def direct_generate(router, prompt_ids):
    # the adapter adds the tool call's closing tag to the stops (a tool turn ends there)
    body = {"input_ids": prompt_ids, "return_logprob": True, "sampling_params": {**SAMPLING, "stop": ["</tool_call>"]}}
    return httpx.post(f"{router.url}/generate", json=body, headers=router.headers, timeout=120,
                      trust_env=False).json()


def assert_session_closed(args, session_id):
    served = run(agent_generate.served_adapter(args))
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=session_id, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="unknown session"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)


def test_generate_runs_the_agent_for_one_sample(args, router, tokenizer, task):
    sample = prompt_samples(task)[0]
    [out] = run(agent_generate.generate(args, sample, dict(SAMPLING)))
    # the prompt is what the agent sent (its messages and its tool), rendered by the chat template
    prompt_ids = list(tokenizer.apply_chat_template(sample.prompt, tools=[GET_WEATHER], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    assert out.tokens[:out.prompt_length] == prompt_ids
    # the random model answers without a tool call: one turn, every response id sampled by the engine and trained
    direct = direct_generate(router, prompt_ids)
    assert out.tokens[out.prompt_length:] == direct["output_ids"] and out.loss_mask == [1] * out.response_length
    assert out.rollout_log_probs == pytest.approx([e[0] for e in direct["meta_info"]["output_token_logprobs"]],
                                                  abs=1e-5)
    assert out.metadata["final_answer"] == direct["text"]
    assert out.metadata["multi_turn"] == {"turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0,
                                          "turn_lengths": [len(direct["output_ids"])], "cut_by_context": False}
    assert out.metadata["conditions"] == sample.metadata["conditions"] and out.label == sample.label
    assert out.index == sample.index
    assert out.status == FINISH_REASON_TO_STATUS[direct["meta_info"]["finish_reason"]["type"]]
    assert run(final_answer_reward(args, out)) == score(direct["text"], sample.label)
    assert_session_closed(args, out.session_id)


async def scripted_tool_agent(client, sample, max_turns):
    """Two real model calls; between them the history says the model called get_weather (it did not: the random
    model cannot), so the history's assistant message is not the one the first turn answered."""
    question = sample.prompt
    await client.chat.completions.create(model="tiny", messages=question, tools=[GET_WEATHER])
    city = question[0]["content"].split(" in ")[1].rstrip("?")
    condition = WeatherService(sample.metadata["conditions"]).get_weather(city)
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": condition}]
    second = await client.chat.completions.create(model="tiny", messages=history, tools=[GET_WEATHER])
    return AgentResult(second.choices[0].message.content, history,
                       [AgentTurn(num_tool_calls=1, tool_seconds=0.5, completion_tokens=8), AgentTurn()])


def test_a_tool_turn_is_context_and_a_rewritten_reply_is_not_trained(args, tokenizer, task):
    """The replayed assistant message (a get_weather call) rewrites the first turn's short reply: slime's manager
    merges it into that turn's node, which stops being trained, and one Sample trains the second turn."""
    sample = prompt_samples(task)[1]
    generate = agent_generate.make_generate(agent=scripted_tool_agent)
    [only] = run(generate(args, sample, dict(SAMPLING)))
    assert only.metadata["turn_indices"] == [1] and only.metadata["multi_turn"]["turns"] == 1
    assert only.metadata["multi_turn"]["tool_calls"] == 0  # the agent's turn 1 made none
    assert "final_answer" in only.metadata  # the episode's answer, for the reward
    # the call and the tool's result are the Sample's context (loss mask 0), never trained
    condition = sample.label
    context = tokenizer.decode(only.tokens[:only.prompt_length])
    assert f"<|im_start|>tool\n{condition}<|im_end|>" in context and '"city": ' in context
    assert only.loss_mask == [1] * only.response_length


async def hanging_agent(client, sample, max_turns):
    hanging_agent.session_id = client.api_key
    await client.chat.completions.create(model="tiny", messages=sample.prompt, tools=[GET_WEATHER])
    await asyncio.sleep(3600)


def test_a_hung_agent_is_cancelled_and_its_sample_aborted(args, task):
    sample = prompt_samples(task)[2]
    generate = agent_generate.make_generate(agent=hanging_agent, episode_timeout_s=2.0)
    started = time.monotonic()
    out = run(generate(args, sample, dict(SAMPLING)))
    assert time.monotonic() - started < 10
    assert out is sample and out.status == Sample.Status.ABORTED and out.tokens == []
    assert_session_closed(args, hanging_agent.session_id)
    with pytest.raises(ValueError, match="episode_timeout_s"):
        agent_generate.make_generate(episode_timeout_s=0)


def test_one_adapter_serves_concurrent_samples_from_any_thread(args, task):
    urls = []

    async def recording_agent(client, sample, max_turns):
        urls.append(str(client.base_url))
        return await agent_generate.weather_agent(client, sample, max_turns)

    generate = agent_generate.make_generate(agent=recording_agent)
    samples = prompt_samples(task)[3:7]

    async def on_rollout_loop():
        return await asyncio.gather(*(generate(args, s, dict(SAMPLING)) for s in samples[:3]))

    from_thread = []
    thread = threading.Thread(target=lambda: from_thread.append(asyncio.run(generate(args, samples[3],
                                                                                     dict(SAMPLING)))))
    thread.start()
    results = run(on_rollout_loop())
    thread.join(timeout=120)
    assert len(results) == 3 and len(from_thread) == 1 and all(len(r) == 1 for r in results + from_thread)
    assert len(urls) == 4 and len(set(urls)) == 1


def test_generate_needs_two_turns(args, task):
    one_turn = args_helpers.make_args(**{**vars(args), "max_turns": 1, "sglang_router_port": 1})
    with pytest.raises(ValueError, match="--max-turns >= 2"):
        run(agent_generate.generate(one_turn, prompt_samples(task)[0], dict(SAMPLING)))


def test_sft_rows_teach_the_turns_the_agent_history_renders(task, tokenizer):
    """The warm start trains the call and the answer as the adapter renders them from the agent's history, and
    masks the rest (system tool block, question, tool result)."""
    from slime.rollout.sft_rollout import tokenize_conversation

    row = json.loads(task["sft"].read_text().splitlines()[0])
    ids, mask = tokenize_conversation(tokenizer, row["messages"], row["tools"])
    history = [dict(m) for m in row["messages"]]
    history[1]["content"] = None  # what the agent appends for a call without text (agent.run_agent)
    assert ids == list(tokenizer.apply_chat_template(history, tools=[GET_WEATHER], tokenize=True, return_dict=False))
    trained, run_ids = [], []
    for token, trainable in zip(ids + [None], mask + [0]):
        if trainable:
            run_ids.append(token)
        elif run_ids:
            trained, run_ids = trained + [tokenizer.decode(run_ids)], []
    city = json.loads(row["messages"][1]["tool_calls"][0]["function"]["arguments"])["city"]
    condition = row["messages"][2]["content"]
    assert trained == [f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'
                       "<|im_end|>\n", f"It is {condition}.<|im_end|>\n"]


# ---------------------------------------------------------------- the agent loop and the reward on their own
class ScriptedCompletions:
    """Stands in for `client.chat.completions`: answers from a list, records what it was sent."""

    def __init__(self, answers):
        self.answers, self.requests = list(answers), []

    async def create(self, **request):
        self.requests.append(json.loads(json.dumps(request)))
        message = self.answers.pop(0)
        return ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            "choices": [{"index": 0, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                         "message": {"role": "assistant", **message}}]})


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_agent_loop_runs_tools_and_sends_their_results_back():
    completions = ScriptedCompletions([
        {"content": None, "tool_calls": [call("a", "get_weather", '{"city": "Rome"}'),
                                         call("b", "get_weather", '{"city": "Oslo"}')]},
        {"content": "It is snowy."}])
    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=completions))
    service = WeatherService({"Oslo": "snowy"})
    result = asyncio.run(run_agent(client, [{"role": "user", "content": "Oslo?"}], [GET_WEATHER], service.execute,
                                   max_turns=3))
    assert result.final_answer == "It is snowy."
    assert [(t.num_tool_calls, t.num_tool_errors) for t in result.turns] == [(2, 1), (0, 0)]
    second_request = completions.requests[1]["messages"]
    assert [m["role"] for m in second_request] == ["user", "assistant", "tool", "tool"]
    assert second_request[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert second_request[2] == {"role": "tool", "tool_call_id": "a",
                                 "content": "error: unknown city 'Rome'; known cities: Oslo"}
    assert second_request[3] == {"role": "tool", "tool_call_id": "b", "content": "snowy"}
    assert completions.requests[0]["tools"] == [GET_WEATHER]


def test_agent_loop_stops_at_its_turn_cap_without_an_answer():
    completions = ScriptedCompletions([{"content": None, "tool_calls": [call("a", "get_weather", "{}")]}] * 2)
    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=completions))
    result = asyncio.run(run_agent(client, [{"role": "user", "content": "?"}], [GET_WEATHER],
                                   WeatherService({}).execute, max_turns=2))
    assert result.final_answer is None and len(completions.requests) == 2
    assert result.messages[-1]["content"] == 'error: get_weather takes {"city": "<name>"}'


def test_weather_tool_errors_name_the_problem():
    service = WeatherService({"Lima": "cloudy"})
    assert service.execute("get_weather", '{"city": "Lima"}') == "cloudy"
    for name, arguments, message in (("get_time", "{}", "unknown tool 'get_time'"),
                                     ("get_weather", "{city", "arguments are not JSON"),
                                     ("get_weather", '["Lima"]', "takes {")):
        with pytest.raises(ToolError, match=message):
            service.execute(name, arguments)


def test_reward_wants_exactly_the_label():
    assert score("It is rainy.", "rainy") == 1.0 and score("RAINY", "rainy") == 1.0
    assert score("It is sunny or rainy.", "rainy") == 0.0  # a hedge names two
    assert score("It is sunny.", "rainy") == 0.0 and score("", "rainy") == 0.0 and score(None, "rainy") == 0.0
    assert score("It is rainyish.", "rainy") == 0.0 and set(CONDITIONS) >= {"rainy"}


# ---------------------------------------------------------------- end to end
@pytest.mark.e2e
@pytest.mark.slow
def test_example_runs_end_to_end(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples" / "openai_agent" / "run.py"), "--out-dir",
                             str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(summary)
    # the SFT warm start taught the call (a random model makes none) and the agent ran the tool
    assert summary["tool_calls_per_sample"] > 0.2 and summary["turns_per_sample"] > 1.1
    assert summary["masked_tokens_per_sample"] > 2  # template and tool-result tokens inside responses, untrained
    assert summary["samples_per_episode"] >= 1.0
    assert summary["reward"] > 0.3  # without the tool's answer the best policy scores 1 / len(CONDITIONS) = 0.25
    assert summary["train_rollout_logprob_abs_diff"] < 1e-3  # trained ids are the engine's, with its log-probs
    # RL moves the episodes from guessing (right one time in four) to calling the tool (README: 0.73 -> 0.98)
    assert summary["reward_after_rl"] > summary["reward_before_rl"] + 0.1
