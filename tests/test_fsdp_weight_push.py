"""Weight push protocol of the FSDP trainer against a stand-in engine process (tests/fsdp_fake_engine.py): every
parameter arrives under its HF name with the trainer's values, in buckets whose last one alone flushes the cache
and carries the weight version; both the tensor-handle and the gloo-broadcast path."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from fsdp_helpers import full_params, make_args, make_train_data, make_trainer

from slime.utils.misc import find_free_port
from slime.utils.tiny_model import build_tiny_model


@pytest.fixture()
def fake_engine(tmp_path):
    port = find_free_port()
    dump = tmp_path / "received.pt"
    repo_root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fsdp_fake_engine.py"), str(port),
                                str(dump)], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        assert process.poll() is None, "fake engine exited"
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        pytest.fail("fake engine did not start")
    yield url, dump
    process.kill()
    process.wait()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("mode,device", [
    ("tensor", "cpu"),
    ("distributed", "cpu"),
    pytest.param("tensor", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_weight_push_delivers_every_parameter(tmp_path, fake_engine, mode, device):
    url, dump = fake_engine
    checkpoint = build_tiny_model(tmp_path / "tiny", arch="qwen3", seed=8)
    trainer = make_trainer(make_args(checkpoint, "--lr", "1e-2", "--update-weight-buffer-size", "40000",
                                     device=device))
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    timings = trainer.update_weights([url], weight_version="7", mode=mode)
    expected = {name.removeprefix("hf_model."): value for name, value in full_params(trainer).items()}

    log = [entry for entry in httpx.get(url + "/received").json() if "names" in entry]
    assert timings["num_buckets"] == len(log) > 2
    assert timings["bytes"] == sum(v.numel() * v.element_size() for v in expected.values())
    assert [e["flush_cache"] for e in log] == [False] * (len(log) - 1) + [True]
    assert [e["weight_version"] for e in log] == [None] * (len(log) - 1) + ["7"]
    assert sorted(n for e in log for n in e["names"]) == sorted(expected)
    httpx.post(url + "/dump", json={})
    received = torch.load(dump, map_location=trainer.device)
    for name, value in expected.items():
        torch.testing.assert_close(received[name], value, rtol=0, atol=0)
