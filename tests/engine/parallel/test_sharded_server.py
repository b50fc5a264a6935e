"""`python -m slime.engine.server --tp-size 2` over HTTP: SGLang's weight-update payloads for a sharded engine (one
serialized entry per rank, sent by another process; a gloo update group where the engine's two ranks join at
rank_offset and rank_offset + 1), each checked against a fresh one-rank engine on the pushed weights; and the engine
as the unit of failure: killing one rank process takes the whole server down, no rank outliving it."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from slime.engine.engine import Engine
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.server.launch import launch_server
from slime.utils.misc import find_free_port
from slime.utils.tiny_model import build_tiny_model
from slime.utils.weight_transport import destroy_custom_process_group, init_custom_process_group
from tests.engine.server.test_weights import broadcast_update, post_in_background

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = list(range(10, 50))
SERVER_ARGS = ["--tp-size", "2", "--device", "cpu", "--kvcache-block-size", "4", "--num-kvcache-blocks", "64"]

# Another process (a trainer's stand-in): one entry per engine rank, each serialized on its own, as slime's
# colocated trainer ranks do before gathering them; `entries` of them go into the request.
SENDER = r"""
import json, sys
import httpx
from safetensors.torch import load_file
from slime.utils.weight_transport import serialize_named_tensors

url, checkpoint, version, entries = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
weights = list(load_file(checkpoint).items())
payload = {"serialized_named_tensors": [serialize_named_tensors(weights) for _ in range(entries)],
           "weight_version": version}
response = httpx.post(url + "/update_weights_from_tensor", json=payload, timeout=120, trust_env=False)
print(json.dumps({"status": response.status_code, "body": response.json()}))
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return [build_tiny_model(tmp_path_factory.mktemp(f"m{seed}"), arch="qwen3", initializer_range=0.3, seed=seed)
            for seed in (0, 1)]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    process = launch_server(models[0], extra_args=SERVER_ARGS, log_path=tmp_path_factory.mktemp("log") / "s.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as http:
        yield http


def generate(client) -> dict:
    response = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert response.status_code == 200, response.text
    return response.json()


def one_rank(model_path) -> dict:
    out = Engine(str(model_path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64).generate(PROMPT, GREEDY)
    return out[0]


def assert_matches(result: dict, reference: dict) -> None:
    assert result["output_ids"] == reference["output_ids"]
    got = torch.tensor([entry[0] for entry in result["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, torch.tensor(reference["output_log_probs"]), atol=1e-5, rtol=0)


def send(server, checkpoint: Path, version: str, entries: int, tmp_path) -> dict:
    out = tmp_path / f"{version}.out"
    with open(out, "w") as stdout:
        returncode = subprocess.call([sys.executable, "-c", SENDER, server.url, str(checkpoint), version,
                                      str(entries)], stdout=stdout, timeout=180,
                                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert returncode == 0
    return json.loads(out.read_text().strip().splitlines()[-1])


def test_serves_one_ranks_output(client, models):
    assert_matches(generate(client), one_rank(models[0]))
    assert client.get("/get_server_info").json()["tp_size"] == 2


def test_tensor_push_reads_one_entry_per_rank(client, server, models, tmp_path):
    sent = send(server, models[1] / "model.safetensors", "t1", 2, tmp_path)
    assert sent["status"] == 200, sent
    assert [(r["rank"], r["weight_version"]) for r in sent["body"]["ranks"]] == [(0, "t1"), (1, "t1")]
    assert_matches(generate(client), one_rank(models[1]))
    wrong = send(server, models[0] / "model.safetensors", "t2", 1, tmp_path)
    assert wrong["status"] == 400 and "list of 2 string(s), one per tensor-parallel rank" in wrong["body"]["error"][
        "message"]
    assert client.get("/get_weight_version").json()["weight_version"] == "t1"


def test_distributed_push_joins_every_rank_at_its_offset(client, server, models):
    group_name, port, results = f"tp-{uuid.uuid4().hex[:6]}", find_free_port(), []
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": group_name, "backend": "gloo"}
    thread = post_in_background(server.url, "/init_weights_update_group", init, results)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=3, rank=0, group_name=group_name)
    thread.join(60)
    assert results and results[0][0] == 200, results
    status, body = broadcast_update(server, group, group_name, list(iterate_checkpoint(models[0])), "d1")
    assert status == 200 and [r["weight_version"] for r in body["ranks"]] == ["d1", "d1"]
    assert_matches(generate(client), one_rank(models[0]))
    assert client.post("/destroy_weights_update_group", json={"group_name": group_name}).status_code == 200
    destroy_custom_process_group(group)
    too_few = {**init, "world_size": 2, "group_name": "x"}
    response = client.post("/init_weights_update_group", json=too_few)
    assert response.status_code == 400 and "rank_offset + tp_rank" in response.json()["error"]["message"]


def test_killing_one_rank_takes_the_engine_down(models, tmp_path):
    server = launch_server(models[0], extra_args=SERVER_ARGS, log_path=tmp_path / "kill.log")
    try:
        ranks = psutil.Process(server.process.pid).children(recursive=True)
        rank_1 = [p for p in ranks if "spawn" in " ".join(p.cmdline())]
        assert rank_1, [p.cmdline() for p in ranks]
        rank_1[0].kill()
        server.process.wait(timeout=30)  # the server exits instead of waiting in a collective
        assert "engine rank 1" in server.log_tail() and "exited" in server.log_tail()
        deadline = time.time() + 10
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        server.stop()


def test_a_hung_rank_takes_the_engine_down_after_the_collective_timeout(models, tmp_path):
    server = launch_server(models[0], extra_args=[*SERVER_ARGS, "--dist-timeout-s", "5"], log_path=tmp_path / "h.log")
    try:
        rank_1 = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                  if "spawn" in " ".join(p.cmdline())][0]
        rank_1.suspend()  # SIGSTOP: alive but never answering its collectives
        with httpx.Client(base_url=server.url, timeout=180, trust_env=False) as http:
            with pytest.raises(httpx.HTTPError):  # the request fails or the connection drops with the server
                response = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
                response.raise_for_status()
        server.process.wait(timeout=120)
        assert "the engine stops with every rank" in server.log_tail(20000)
        rank_1.wait(timeout=10)  # killed with its parent, stopped or not
    finally:
        server.stop()


def test_openai_completions_pause_continue_and_server_state_at_two_ranks(client, models):
    response = client.post("/v1/completions", json={"model": "x", "prompt": "hello world", "max_tokens": 5,
                                                    "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5, response.text
    assert client.post("/pause_generation", json={}).status_code == 200
    assert client.post("/continue_generation", json={}).status_code == 200
    assert generate(client)["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    info = client.get("/get_server_info").json()
    assert info["internal_states"][0]["paused"] is False and info["tp_size"] == 2
