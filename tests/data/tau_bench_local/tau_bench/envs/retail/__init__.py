"""The retail domain: an online shop's customer-service agent, its policy (wiki), tools and tasks."""

from __future__ import annotations

from tau_bench.envs.base import Env
from tau_bench.envs.retail.data import load_data
from tau_bench.envs.retail.tasks import TASKS
from tau_bench.envs.retail.tools import ALL_TOOLS

WIKI = """Retail agent policy: authenticate the user by email first; only pending orders can be cancelled, for
'no longer needed' or 'ordered by mistake'."""

RULES = ["Authenticate before acting.", "Only pending orders can be cancelled."]


class MockRetailDomainEnv(Env):
    def __init__(self, user_strategy: str = "llm", user_model: str = "gpt-4o", user_provider: str | None = None,
                 task_split: str = "test", task_index: int | None = None) -> None:
        if task_split not in TASKS:
            raise ValueError(f"Unknown task split: {task_split} (retail has {sorted(TASKS)})")
        super().__init__(data_load_func=load_data, tools=ALL_TOOLS, tasks=TASKS[task_split], wiki=WIKI, rules=RULES,
                         user_strategy=user_strategy, user_model=user_model, user_provider=user_provider,
                         task_index=task_index)
