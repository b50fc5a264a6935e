"""tau-bench's tool-calling agent: an LLM with the domain's tools (OpenAI function calling) and its wiki as the
system prompt; the first tool call of a turn is the action, a turn without one is a reply to the user."""

from __future__ import annotations

import json

from tau_bench.agents.base import Agent
from tau_bench.envs.base import Env
from tau_bench.llm import completion
from tau_bench.types import RESPOND_ACTION_NAME, Action, SolveResult


class ToolCallingAgent(Agent):
    def __init__(self, tools_info: list[dict], wiki: str, model: str, provider: str, temperature: float = 0.0):
        self.tools_info = tools_info
        self.wiki = wiki
        self.model = model
        self.provider = provider
        self.temperature = temperature

    def solve(self, env: Env, task_index: int | None = None, max_num_steps: int = 30) -> SolveResult:
        reset = env.reset(task_index=task_index)
        info = reset.info.model_dump()
        reward = 0.0
        messages = [{"role": "system", "content": self.wiki}, {"role": "user", "content": reset.observation}]
        for _ in range(max_num_steps):
            res = completion(model=self.model, provider=self.provider, messages=messages, tools=self.tools_info,
                             temperature=self.temperature)
            message = res.choices[0].message.model_dump(exclude_none=True)
            message["role"] = "assistant"
            action = message_to_action(message)
            response = env.step(action)
            reward = response.reward
            info = {**info, **response.info.model_dump()}
            if action.name != RESPOND_ACTION_NAME:
                message["tool_calls"] = message["tool_calls"][:1]
                call = message["tool_calls"][0]
                messages += [message, {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                                       "content": response.observation}]
            else:
                messages += [message, {"role": "user", "content": response.observation}]
            if response.done:
                break
        return SolveResult(reward=reward, info=info, messages=messages, total_cost=0.0)


def message_to_action(message: dict) -> Action:
    if message.get("tool_calls"):
        call = message["tool_calls"][0]["function"]
        return Action(name=call["name"], kwargs=json.loads(call["arguments"]))
    return Action(name=RESPOND_ACTION_NAME, kwargs={"content": message.get("content") or ""})
