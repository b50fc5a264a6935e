"""Weight updates of a running engine server (a subprocess on a tiny model): from tensors serialized by another
process (shared memory handles), from disk, and by torch.distributed broadcast over a gloo group where this test
process is rank 0. Each update changes the output and the weight version and flushes the prefix cache; pushing the
original weights back restores the original output; bad names / shapes are rejected and change nothing."""

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slime.utils.misc import find_free_port
from slime.utils.tiny_model import build_tiny_model
from slime.utils.weight_transport import (
    broadcast_named_tensors,
    destroy_custom_process_group,
    init_custom_process_group,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
PROMPT = list(range(10, 50))  # 40 tokens: the prefix cache holds two full blocks of it

# Runs in a separate process: load the checkpoint, optionally change it, send it by handle, print the response.
SENDER = r"""
import json, sys
import httpx, torch
from safetensors.torch import load_file
from slime.utils.weight_transport import serialize_named_tensors

url, checkpoint, mode, version = sys.argv[1:5]
weights = load_file(checkpoint)
if mode == "random_norm":  # a random final norm (not a random embedding: tied ones keep echoing the prompt)
    torch.manual_seed(1234)
    weights = {"model.norm.weight": torch.randn_like(weights["model.norm.weight"])}
elif mode == "bad_name":
    weights = {"model.layers.0.not_a_weight": torch.zeros(3), **weights}
elif mode == "bad_shape":
    weights = {"model.norm.weight": torch.zeros(7)}
payload = {"serialized_named_tensors": [serialize_named_tensors(list(weights.items()))], "weight_version": version}
response = httpx.post(url + "/update_weights_from_tensor", json=payload, timeout=120, trust_env=False)
print(json.dumps({"status": response.status_code, "body": response.json()}))
"""


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen3) -> Path:
    return Path(tiny_qwen3) / "model.safetensors"


def generate(client) -> dict:
    response = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert response.status_code == 200, response.text
    return response.json()


def log_probs(result) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def same_output(a, b) -> bool:
    return a["output_ids"] == b["output_ids"] and log_probs(a) == pytest.approx(log_probs(b), abs=1e-5)


def weight_version(client) -> str:
    return client.get("/get_weight_version").json()["weight_version"]


def send_from_other_process(server, checkpoint, mode, version, tmp_path) -> dict:
    # Output goes to files, not pipes: the sender's torch_shm_manager child inherits its stdio and outlives it.
    out, err = tmp_path / f"{mode}-{version}.out", tmp_path / f"{mode}-{version}.err"
    repo_root = str(Path(__file__).resolve().parents[3])
    with open(out, "w") as stdout, open(err, "w") as stderr:
        returncode = subprocess.call(
            [sys.executable, "-c", SENDER, server.url, str(checkpoint), mode, version],
            stdout=stdout, stderr=stderr, timeout=120, env={**os.environ, "PYTHONPATH": repo_root},
        )
    assert returncode == 0, err.read_text()[-3000:]
    return json.loads(out.read_text().strip().splitlines()[-1])


def warm_prefix_cache(client) -> dict:
    generate(client)
    result = generate(client)
    assert result["meta_info"]["cached_tokens"] >= 32
    return result


def test_update_from_tensor_sent_by_another_process(client, server, checkpoint, tmp_path):
    original = warm_prefix_cache(client)
    sent = send_from_other_process(server, checkpoint, "random_norm", "tensor-1", tmp_path)
    assert sent["status"] == 200
    assert {k: sent["body"][k] for k in ("success", "message")} == {"success": True,
                                                                      "message": "Succeeded to update model weights."}
    assert [(r["rank"], r["weight_version"]) for r in sent["body"]["ranks"]] == [(0, "tensor-1")]
    changed = generate(client)
    assert changed["meta_info"]["cached_tokens"] == 0  # the update flushed the prefix cache
    assert changed["output_ids"] != original["output_ids"]
    assert changed["meta_info"]["weight_version"] == weight_version(client) == "tensor-1"

    assert send_from_other_process(server, checkpoint, "original", "tensor-2", tmp_path)["status"] == 200
    restored = generate(client)
    assert same_output(restored, original) and restored["text"] == original["text"]
    assert weight_version(client) == "tensor-2"


@pytest.mark.parametrize("mode, fragment", [("bad_name", "not_a_weight"), ("bad_shape", "model.norm.weight")])
def test_update_from_tensor_rejects_bad_weights_without_changing_the_model(
    client, server, checkpoint, mode, fragment, tmp_path
):
    before, version = generate(client), weight_version(client)
    sent = send_from_other_process(server, checkpoint, mode, "never", tmp_path)
    assert sent["status"] == 400 and fragment in sent["body"]["error"]["message"]
    assert same_output(generate(client), before) and weight_version(client) == version


def test_update_from_disk(client, tiny_qwen3, tmp_path):
    original = warm_prefix_cache(client)
    other = build_tiny_model(tmp_path / "other", arch="qwen3", seed=1)
    response = client.post("/update_weights_from_disk", json={"model_path": str(other), "weight_version": "disk-1"})
    assert response.status_code == 200 and response.json()["success"] is True
    changed = generate(client)
    assert not same_output(changed, original) and changed["meta_info"]["cached_tokens"] == 0
    assert changed["meta_info"]["weight_version"] == "disk-1"
    assert client.post("/update_weights_from_disk", json={"model_path": str(tiny_qwen3)}).status_code == 200
    assert same_output(generate(client), original)
    assert weight_version(client) not in ("disk-1", "tensor-2")  # bumped without an explicit version


def post_in_background(url, path, body, results):
    def run():
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
            response = http.post(path, json=body)
            results.append((response.status_code, response.json()))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def broadcast_update(server, group, group_name, named_tensors, version, names=None):
    """POST /update_weights_from_distributed and broadcast the tensors from this process (rank 0) meanwhile."""
    body = {
        "names": names or [name for name, _ in named_tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
        "group_name": group_name,
        "weight_version": version,
        "flush_cache": True,
    }
    results = []
    thread = post_in_background(server.url, "/update_weights_from_distributed", body, results)
    broadcast_named_tensors(group, named_tensors, src=0)
    thread.join(120)
    return results[0]


def test_update_from_distributed_broadcast(client, server, checkpoint):
    original = warm_prefix_cache(client)
    group_name = f"test-{uuid.uuid4().hex[:8]}"
    port = find_free_port()
    results = []
    init_body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                 "group_name": group_name, "backend": "gloo"}
    thread = post_in_background(server.url, "/init_weights_update_group", init_body, results)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group_name)
    thread.join(60)
    assert results == [(200, {"success": True, "message": "Succeeded to initialize custom process group."})]

    weights = load_file(str(checkpoint))
    torch.manual_seed(7)
    changed_weights = [(name, torch.randn_like(t)) for name, t in weights.items() if name == "model.norm.weight"]
    status, body = broadcast_update(server, group, group_name, changed_weights, "dist-1")
    assert (status, body["success"]) == (200, True)
    changed = generate(client)
    assert changed["output_ids"] != original["output_ids"] and changed["meta_info"]["cached_tokens"] == 0
    assert weight_version(client) == "dist-1"

    # A wrong name is rejected after the broadcast completes (so the trainer never hangs); nothing changes.
    status, body = broadcast_update(server, group, group_name, changed_weights[:1], "dist-bad", names=["model.nope"])
    assert status == 400 and "model.nope" in body["error"]["message"]
    assert weight_version(client) == "dist-1"

    status, _ = broadcast_update(server, group, group_name, list(weights.items()), "dist-2")
    assert status == 200
    assert same_output(generate(client), original)

    response = client.post("/destroy_weights_update_group", json={"group_name": group_name})
    assert response.status_code == 200 and response.json()["success"] is True
    destroy_custom_process_group(group)
    assert client.post("/destroy_weights_update_group", json={"group_name": group_name}).status_code == 400
