"""SGLang's LoRA routes on a running engine server (a subprocess on the tiny Qwen3, fp32 on the CPU): a PEFT folder
loaded by /load_lora_adapter and selected per request with `lora_path` gives transformers' merged-weight log-probs;
one /generate batch mixes an adapter and the base model; an adapter pushed by another process through
/load_lora_adapter_from_tensors answers a float64 checksum per tensor equal to the sender's; the OpenAI endpoint
selects an adapter by model name; mistakes are 400s naming the problem."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from slime.utils.weight_transport import serialize_named_tensors
from tests.helpers.lora_adapters import merged_log_probs, random_adapter, write_peft_folder

SERVER_ARGS = ["--device", "cpu", "--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "2"]
PROMPT = list(range(10, 30))
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

# Runs in a separate process: a random adapter (same generator as the test's), pushed by handle; prints the reply
# and the sender's own float64 sums.
SENDER = r"""
import json, sys
import httpx
from transformers import AutoConfig
from slime.utils.weight_transport import serialize_named_tensors
from tests.helpers.lora_adapters import random_adapter

url, model_path, name, seed, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
config, tensors = random_adapter(AutoConfig.from_pretrained(model_path), rank=rank, alpha=2 * rank, seed=seed)
sums = {n: float(t.double().sum()) for n, t in tensors.items()}
payload = {"lora_name": name, "config": config, "weight_version": "7",
           "serialized_named_tensors": [serialize_named_tensors(list(tensors.items()))]}
response = httpx.post(url + "/load_lora_adapter_from_tensors", json=payload, timeout=120, trust_env=False)
print(json.dumps({"status": response.status_code, "body": response.json(), "sums": sums}))
"""


@pytest.fixture(scope="module")
def hf_config(tiny_qwen3):
    return AutoConfig.from_pretrained(str(tiny_qwen3))


@pytest.fixture(scope="module")
def folder_adapter(hf_config, tmp_path_factory):
    """(config, tensors, folder) of a PEFT folder beside the checkpoint (inside the server's default allowlist)."""
    config, tensors = random_adapter(hf_config, rank=4, alpha=8, seed=11)
    return config, tensors, write_peft_folder(tmp_path_factory.mktemp("adapter"), config, tensors)


def generate(client, lora_path=None, input_ids=PROMPT) -> dict:
    body = {"input_ids": input_ids, "sampling_params": GREEDY, "return_logprob": True}
    if lora_path is not None:
        body["lora_path"] = lora_path
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def log_probs(result) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def push_from_other_process(server, model_path, name, seed, rank, tmp_path) -> dict:
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"  # files: torch_shm_manager outlives the sender
    repo_root = str(Path(__file__).resolve().parents[3])
    with open(out, "w") as stdout, open(err, "w") as stderr:
        returncode = subprocess.call([sys.executable, "-c", SENDER, server.url, str(model_path), name, str(seed),
                                      str(rank)], stdout=stdout, stderr=stderr, timeout=180,
                                     env={**os.environ, "PYTHONPATH": repo_root})
    assert returncode == 0, err.read_text()[-3000:]
    return json.loads(out.read_text().strip().splitlines()[-1])


def test_folder_adapter_matches_merged_transformers(client, tiny_qwen3, folder_adapter):
    config, tensors, folder = folder_adapter
    response = client.post("/load_lora_adapter", json={"lora_name": "folder", "lora_path": str(folder)})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] and body["loaded_adapters"] == {"folder": str(folder)}
    assert body["checksums"] == pytest.approx({n: float(t.double().sum()) for n, t in tensors.items()}, abs=1e-9)
    result = generate(client, "folder")
    expected = merged_log_probs(tiny_qwen3, config, tensors, PROMPT + result["output_ids"], len(PROMPT))
    assert log_probs(result) == pytest.approx(expected, abs=1e-4)
    base = merged_log_probs(tiny_qwen3, None, None, PROMPT + result["output_ids"], len(PROMPT))
    assert max(abs(x - y) for x, y in zip(base, expected)) > 0.1
    # one batch: the adapter for the first prompt, the base model for the second
    batch = generate(client, ["folder", None], [PROMPT, PROMPT])
    assert log_probs(batch[0]) == pytest.approx(log_probs(result), abs=1e-5)
    assert log_probs(batch[1]) == pytest.approx(log_probs(generate(client)), abs=1e-5)
    # the OpenAI endpoint: model = the adapter's name
    completion = client.post("/v1/completions", json={"model": "folder", "prompt": PROMPT, "max_tokens": 8,
                                                      "temperature": 0.0, "logprobs": 0})
    assert completion.status_code == 200, completion.text
    openai_log_probs = completion.json()["choices"][0]["logprobs"]["token_logprobs"]  # may stop at EOS
    assert openai_log_probs and openai_log_probs == pytest.approx(log_probs(result)[: len(openai_log_probs)], abs=1e-5)
    assert "folder" in [model["id"] for model in client.get("/v1/models").json()["data"]]


def test_tensor_push_from_another_process_answers_checksums(client, server, tiny_qwen3, hf_config, tmp_path):
    pushed = push_from_other_process(server, tiny_qwen3, "policy@1", seed=21, rank=8, tmp_path=tmp_path)
    assert pushed["status"] == 200, pushed["body"]
    assert pushed["body"]["lora_name"] == "policy@1" and pushed["body"]["weight_version"] == "7"
    assert set(pushed["body"]["checksums"]) == set(pushed["sums"])
    for name, expected in pushed["sums"].items():
        assert pushed["body"]["checksums"][name] == pytest.approx(expected, rel=1e-12, abs=1e-12), name
    config, tensors = random_adapter(hf_config, rank=8, alpha=16, seed=21)
    result = generate(client, "policy@1")
    expected = merged_log_probs(tiny_qwen3, config, tensors, PROMPT + result["output_ids"], len(PROMPT))
    assert log_probs(result) == pytest.approx(expected, abs=1e-4)
    # both slots are taken: a third adapter is refused until one is unloaded
    third = push_from_other_process(server, tiny_qwen3, "policy@2", seed=22, rank=2, tmp_path=tmp_path)
    assert third["status"] == 400 and "all 2 LoRA slots are in use" in third["body"]["error_message"]
    assert client.post("/unload_lora_adapter", json={"lora_name": "policy@1"}).status_code == 200
    again = push_from_other_process(server, tiny_qwen3, "policy@2", seed=22, rank=2, tmp_path=tmp_path)
    assert again["status"] == 200, again["body"]
    assert again["body"]["loaded_adapters"].keys() == {"folder", "policy@2"}


def test_mistakes_are_400s_naming_the_problem(client, server, tiny_qwen3, tmp_path):
    unknown = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "nope"})
    assert unknown.status_code == 400 and "unknown LoRA adapter 'nope'" in unknown.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 400
    too_big = push_from_other_process(server, tiny_qwen3, "big", seed=3, rank=16, tmp_path=tmp_path)
    assert too_big["status"] == 400 and "exceeds the engine's max_lora_rank=8" in too_big["body"]["error_message"]
    not_peft = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(Path(tiny_qwen3))})
    assert not_peft.status_code == 400 and "is not a PEFT adapter folder" in not_peft.text
    outside = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})
    assert outside.status_code == 400 and "outside the folders" in outside.text
    def push(config, name):  # serialized anew each time: a serialized list is deserialized once
        tensors = [(name, torch.ones(2, 2))]
        return client.post("/load_lora_adapter_from_tensors", json={
            "lora_name": "x", "config": config, "serialized_named_tensors": [serialize_named_tensors(tensors)]})

    response = push({"r": 2, "lora_alpha": 4}, "model.layers.0.self_attn.q_proj.lora_A.weight")
    assert response.status_code == 400 and "must start with 'base_model.model.'" in response.json()["error_message"]
    response = push({"lora_alpha": 4}, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert response.status_code == 400 and "'r' must be a positive int" in response.json()["error_message"]
    two_items = {"lora_name": "x", "config": {"r": 2}, "serialized_named_tensors": ["a", "b"]}
    response = client.post("/load_lora_adapter_from_tensors", json=two_items)
    assert response.status_code == 400 and "a list of 1 string(s), one per engine rank" in response.text
    bad_list = client.post("/generate", json={"input_ids": [PROMPT, PROMPT], "lora_path": ["folder"]})
    assert bad_list.status_code == 400 and "'lora_path' must be" in bad_list.text


def test_lora_path_survives_sglang_router(client, server, folder_adapter):
    """slime's rollout reaches the engines through sglang-router, which re-serializes /generate: `lora_path` must
    arrive (a dropped one would silently sample the base model)."""
    import httpx

    from slime.ray.router import RouterProcess, register_worker

    if "folder" not in [model["id"] for model in client.get("/v1/models").json()["data"]]:  # run alone
        response = client.post("/load_lora_adapter", json={"lora_name": "folder", "lora_path": str(folder_adapter[2])})
        assert response.status_code == 200, response.text
    direct, base = generate(client, "folder"), generate(client)
    router = RouterProcess(policy="round_robin")
    try:
        register_worker(router.url, server.url)
        with httpx.Client(base_url=router.url, timeout=120, trust_env=False, headers=router.headers) as routed:
            through_router = generate(routed, "folder")
    finally:
        router.shutdown()
    assert log_probs(through_router) == pytest.approx(log_probs(direct), abs=1e-5)
    assert log_probs(through_router) != pytest.approx(log_probs(base), abs=1e-3)
