"""tau-bench's LLM user simulator: an LLM plays the customer from the task's instruction; "###STOP###" ends it."""

from __future__ import annotations

import abc
import enum
import os

from tau_bench.llm import completion


class UserStrategy(enum.Enum):
    LLM = "llm"


class BaseUserSimulationEnv(abc.ABC):
    @abc.abstractmethod
    def reset(self, instruction: str | None = None) -> str: ...

    @abc.abstractmethod
    def step(self, content: str) -> str: ...

    @abc.abstractmethod
    def get_total_cost(self) -> float: ...


class LLMUserSimulationEnv(BaseUserSimulationEnv):
    def __init__(self, model: str, provider: str) -> None:
        self.messages: list[dict] = []
        self.model = model
        self.provider = provider
        self.total_cost = 0.0
        self.reset()

    def generate_next_message(self, messages: list[dict]) -> str:
        api_base = os.environ.get("USER_MODEL_API_BASE")
        if not api_base:
            raise ValueError("the LLM user simulator needs USER_MODEL_API_BASE (its OpenAI-compatible server's /v1 "
                             "URL)")
        res = completion(model=self.model, provider=self.provider, messages=messages, api_base=api_base)
        message = res.choices[0].message
        self.messages.append({"role": "assistant", "content": message.content})
        return message.content or ""

    def build_system_prompt(self, instruction: str | None) -> str:
        instruction_display = f"\n\nInstruction: {instruction}\n" if instruction is not None else ""
        return (f"You are a user interacting with an agent.{instruction_display}\nRules:\n"
                "- Just generate one line at a time to simulate the user's message.\n"
                "- Do not give away all the instruction at once.\n"
                "- If the instruction goal is satisified, generate '###STOP###' as a standalone message.")

    def reset(self, instruction: str | None = None) -> str:
        self.messages = [{"role": "system", "content": self.build_system_prompt(instruction)},
                         {"role": "user", "content": "Hi! How can I help you today?"}]
        return self.generate_next_message(self.messages)

    def step(self, content: str) -> str:
        self.messages.append({"role": "user", "content": content})
        return self.generate_next_message(self.messages)

    def get_total_cost(self) -> float:
        return self.total_cost


def load_user(user_strategy: str | UserStrategy, model: str | None = "gpt-4o",
              provider: str | None = None) -> BaseUserSimulationEnv:
    strategy = user_strategy.value if isinstance(user_strategy, UserStrategy) else user_strategy
    if strategy != UserStrategy.LLM.value:
        raise ValueError(f"user_strategy {strategy!r}: this tau_bench has the 'llm' user simulator only")
    if provider is None:
        raise ValueError("the 'llm' user simulator needs a user provider (RunConfig.user_model_provider)")
    return LLMUserSimulationEnv(model=model, provider=provider)
