"""The engine's memory occupation tags (SGLang's release_memory_occupation / resume_memory_occupation names) and
the error raised when the engine is asked to generate or load weights while that memory is released. Not here:
the release and resume themselves (engine.py, model_runner.py, host_weights.py)."""

from __future__ import annotations

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineMemoryReleasedError(RuntimeError):
    """Raised when generating or updating weights while that memory is released."""


def memory_tags(tags) -> list[str]:
    """`tags` (None: all, one name, or a list) checked against MEMORY_TAGS."""
    if tags is None:
        return list(MEMORY_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; valid tags: {list(MEMORY_TAGS)}")
    return list(tags)
