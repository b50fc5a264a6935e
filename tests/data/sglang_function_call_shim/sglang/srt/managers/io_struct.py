"""SGLang's `Function` / `Tool` request models (OpenAI's tool schema), by the names slime's tau-bench example
imports."""

from __future__ import annotations

from pydantic import BaseModel


class Function(BaseModel):
    description: str | None = None
    name: str | None = None
    parameters: object | None = None
    strict: bool = False


class Tool(BaseModel):
    type: str = "function"
    function: Function
