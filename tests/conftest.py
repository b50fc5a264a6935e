"""Shared fixtures: tiny offline checkpoints, the GPU skip rule, and no default process group leaking from one
in-process trainer test into the next."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernel tests run in Triton's interpreter, which triton reads once, at its import: set it
# before any test module is collected (a module collected earlier may import triton through megatron-core or
# transformers, and the kernels would then be compiled for a GPU that is not there).
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_ignore_collect(collection_path, config):
    """slime's plugin contract tests put stubs in sys.modules for ray, transformers and sglang_router when those are
    not imported yet, which would break every later test of a session: tests/compat/test_slime_plugin_contracts.py runs
    them in a fresh interpreter (SLIME_PLUGIN_CONTRACTS=1)."""
    if collection_path.name == "plugin_contracts" and os.environ.get("SLIME_PLUGIN_CONTRACTS") != "1":
        return True
    return None


def pytest_collection_modifyitems(config, items):
    import torch

    if os.environ.get("SLIME_RUN_SLOW") != "1":
        skip_slow = pytest.mark.skip(reason="a long example run: SLIME_RUN_SLOW=1 runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3")


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory, request):
    """A real engine server subprocess on the tiny checkpoint, one per test module (extra flags: the module's
    SERVER_ARGS)."""
    from slime.engine.server.launch import launch_server

    extra_args = getattr(request.module, "SERVER_ARGS", [])
    process = launch_server(tiny_qwen3, extra_args=extra_args, log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as http:
        yield http


@pytest.fixture(autouse=True)
def _fresh_process_group():
    """A test that built an in-process trainer leaves torch.distributed's default group behind; destroy it."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
