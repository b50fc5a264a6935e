"""`get_env`: the environment of one tau-bench domain (here: retail)."""

from __future__ import annotations

from tau_bench.envs.base import Env


def get_env(env_name: str, user_strategy: str, user_model: str, task_split: str, user_provider: str | None = None,
            task_index: int | None = None) -> Env:
    if env_name == "retail":
        from tau_bench.envs.retail import MockRetailDomainEnv

        return MockRetailDomainEnv(user_strategy=user_strategy, user_model=user_model, task_split=task_split,
                                   user_provider=user_provider, task_index=task_index)
    raise ValueError(f"Unknown environment: {env_name} (this tau_bench has 'retail' only)")
