"""tau-bench's tool interface: a class with `invoke(data, **kwargs) -> str` and its OpenAI schema `get_info()`."""

from __future__ import annotations

import abc
from typing import Any


class Tool(abc.ABC):
    @staticmethod
    @abc.abstractmethod
    def invoke(*args, **kwargs) -> str: ...

    @staticmethod
    @abc.abstractmethod
    def get_info() -> dict[str, Any]: ...
