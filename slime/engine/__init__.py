"""The built-in inference engine: paged KV cache, continuous batching, prefix cache, overlapped scheduling, CUDA
graphs, and an SGLang-compatible HTTP server (`python -m slime.engine.server`, in `server/`).

The Python API, imported on first use so that the torch-free parts (scheduler, block manager, sequence) stay
importable without torch:

    from slime.engine import Engine, SamplingParams
    engine = Engine("path/to/hf_model", device="cpu")
    outputs = engine.generate([[1, 2, 3]], {"max_new_tokens": 8})  # dicts: SamplingParams fields

`Engine` (engine.py), `Config` (config.py, the knobs `Engine(**config)` takes), `SamplingParams`
(sampling_params.py) and `RequestOutput` (request_output.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "slime.engine.engine", "Config": "slime.engine.config",
            "SamplingParams": "slime.engine.sampling_params", "RequestOutput": "slime.engine.request_output"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slime.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
