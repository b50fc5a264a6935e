"""tau-bench's agent interface: `solve(env, task_index, max_num_steps) -> SolveResult`."""

from __future__ import annotations

import abc

from tau_bench.envs.base import Env
from tau_bench.types import SolveResult


class Agent(abc.ABC):
    @abc.abstractmethod
    def solve(self, env: Env, task_index: int | None = None, max_num_steps: int = 30) -> SolveResult: ...
