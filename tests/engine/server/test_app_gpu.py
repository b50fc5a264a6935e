"""GPU only: the engine server on CUDA takes a weight update from another process by CUDA IPC handles
(`serialize_named_tensors` on CUDA tensors), changes its output and version, and returns to the original output
when the original weights are pushed back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from slime.engine.server.launch import launch_server

pytestmark = pytest.mark.gpu

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
PROMPT = list(range(10, 50))

SENDER = r"""
import json, sys
import httpx, torch
from safetensors.torch import load_file
from slime.utils.weight_transport import serialize_named_tensors

url, checkpoint, mode, version = sys.argv[1:5]
weights = {name: t.to("cuda", torch.bfloat16) for name, t in load_file(checkpoint).items()}
if mode == "random_norm":
    torch.manual_seed(1234)
    weights = {"model.norm.weight": torch.randn_like(weights["model.norm.weight"])}
payload = {"serialized_named_tensors": [serialize_named_tensors(list(weights.items()))], "weight_version": version}
response = httpx.post(url + "/update_weights_from_tensor", json=payload, timeout=120, trust_env=False)
torch.cuda.synchronize()
print(json.dumps({"status": response.status_code, "body": response.json()}))
"""


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    process = launch_server(
        tiny_qwen3, extra_args=["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"],
        log_path=log,
    )
    yield process
    process.stop()


def generate(client):
    response = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert response.status_code == 200, response.text
    return response.json()


def send(server, checkpoint, mode, version, tmp_path):
    out = tmp_path / f"{mode}.out"
    with open(out, "w") as stdout:
        returncode = subprocess.call(
            [sys.executable, "-c", SENDER, server.url, str(checkpoint), mode, version], stdout=stdout,
            stderr=subprocess.STDOUT, timeout=300,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
        )
    assert returncode == 0, out.read_text()[-3000:]
    # stderr is merged in: torch may warn about IPC blocks after the JSON line.
    return json.loads([line for line in out.read_text().splitlines() if line.startswith("{")][-1])


def test_update_from_cuda_ipc_tensors(server, tiny_qwen3, tmp_path):
    checkpoint = Path(tiny_qwen3) / "model.safetensors"
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as client:
        original = generate(client)
        assert send(server, checkpoint, "random_norm", "ipc-1", tmp_path)["status"] == 200
        changed = generate(client)
        assert changed["output_ids"] != original["output_ids"]
        assert changed["meta_info"]["weight_version"] == "ipc-1" and changed["meta_info"]["cached_tokens"] == 0
        assert send(server, checkpoint, "original", "ipc-2", tmp_path)["status"] == 200
        restored = generate(client)
        assert restored["output_ids"] == original["output_ids"]
        assert client.get("/get_weight_version").json() == {"weight_version": "ipc-2"}
