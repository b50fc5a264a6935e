"""tau-bench's environment loop: the agent acts (a tool call or a reply to the user), the environment answers, and
at the end the reward compares what the agent did with the task's ground truth."""

from __future__ import annotations

import json
import random
from hashlib import sha256
from typing import Any, Callable

from tau_bench.envs.tool import Tool
from tau_bench.envs.user import load_user
from tau_bench.types import (
    RESPOND_ACTION_NAME,
    Action,
    EnvInfo,
    EnvResetResponse,
    EnvResponse,
    RewardActionInfo,
    RewardOutputInfo,
    RewardResult,
    Task,
)


def data_hash(data: dict[str, Any]) -> str:
    return sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class Env:
    def __init__(self, data_load_func: Callable[[], dict[str, Any]], tools: list[type[Tool]], tasks: list[Task],
                 wiki: str, rules: list[str], user_strategy: str, user_model: str, user_provider: str | None = None,
                 task_index: int | None = None) -> None:
        self.data_load_func = data_load_func
        self.data = data_load_func()
        self.tools_map = {tool.get_info()["function"]["name"]: tool for tool in tools}
        self.tools_info = [tool.get_info() for tool in tools]
        self.terminate_tools: list[str] = []
        self.tasks = tasks
        self.task_index = task_index if task_index is not None else random.randrange(len(tasks))
        self.task = tasks[self.task_index]
        self.wiki = wiki
        self.rules = rules
        self.user = load_user(user_strategy=user_strategy, model=user_model, provider=user_provider)
        self.actions: list[Action] = []

    def reset(self, task_index: int | None = None) -> EnvResetResponse:
        self.task_index = task_index if task_index is not None else random.randrange(len(self.tasks))
        self.data = self.data_load_func()
        self.task = self.tasks[self.task_index]
        self.actions = []
        observation = self.user.reset(instruction=self.task.instruction)
        return EnvResetResponse(observation=observation, info=EnvInfo(task=self.task, source="user"))

    def step(self, action: Action) -> EnvResponse:
        self.actions.append(action)
        info = EnvInfo(task=self.task)
        reward, done = 0.0, False
        if action.name == RESPOND_ACTION_NAME:
            observation = self.user.step(action.kwargs["content"])
            info.source = "user"
            done = "###STOP###" in observation
        elif action.name in self.tools_map:
            try:
                observation = self.tools_map[action.name].invoke(data=self.data, **action.kwargs)
            except Exception as error:  # tau-bench answers a failed tool call with its error, to the agent
                observation = f"Error: {error}"
            info.source = action.name
            done = action.name in self.terminate_tools
        else:
            observation = f"Unknown action {action.name}"
            info.source = action.name
        if done:
            reward_result = self.calculate_reward()
            reward = reward_result.reward
            info.reward_info = reward_result
            info.user_cost = self.user.get_total_cost()
        return EnvResponse(observation=observation, reward=reward, done=done, info=info)

    def calculate_reward(self) -> RewardResult:
        """1 if the agent told the user every expected output (tasks with outputs), else 1 if the database the agent
        left equals the one the task's ground-truth actions leave."""
        actions = [action for action in self.task.actions if action.name != RESPOND_ACTION_NAME]
        if self.task.outputs:
            replies = [a.kwargs["content"].lower().replace(",", "") for a in self.actions
                       if a.name == RESPOND_ACTION_NAME]
            outputs = {output: any(output.lower() in reply for reply in replies) for output in self.task.outputs}
            r_outputs = float(all(outputs.values()))
            return RewardResult(reward=r_outputs, info=RewardOutputInfo(r_outputs=r_outputs, outputs=outputs),
                                actions=actions)
        agent_hash = data_hash(self.data)
        self.data = self.data_load_func()
        for action in actions:
            if action.name not in self.terminate_tools:
                self.tools_map[action.name].invoke(data=self.data, **action.kwargs)
        gt_hash = data_hash(self.data)
        r_actions = float(agent_hash == gt_hash)
        return RewardResult(reward=r_actions, info=RewardActionInfo(r_actions=r_actions, gt_data_hash=gt_hash),
                            actions=actions)
