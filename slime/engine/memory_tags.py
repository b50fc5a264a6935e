"""The engine's memory occupation tags (SGLang's release_memory_occupation / resume_memory_occupation names) and
the errors raised when the engine is asked to generate or load weights while that memory is released, or
while discarded weights are not all loaded again. Not here:
the release and resume themselves (engine.py, model_runner.py, host_weights.py)."""

from __future__ import annotations

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineMemoryReleasedError(RuntimeError):
    """Raised when generating or updating weights while that memory is released (the HTTP loop holds new requests
    until the resume)."""


class EngineWeightsMissingError(RuntimeError):
    """Raised when generating while the memory is resident but weights discarded by a release are not all loaded
    again (a push that did not reach every bucket): nothing will load them by waiting, so requests fail at once."""


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
