"""The engine server (a subprocess) on a tiny Qwen2.5-VL: SGLang's /generate with image_data as a path, a file URL,
a data URI or bare base64, from text or from token ids (one pad per image or the processor's expansion), all giving
transformers' log-probs; bad images are 400s naming them; the vision tower and the language model update through
tensors (legacy and new weight names), disk and a torch.distributed broadcast, and pushing the original weights back
restores the original output."""

import base64
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slime.utils.image_policy import IMAGE_PLACEHOLDER, load_vl_processor
from slime.utils.misc import find_free_port
from slime.utils.tiny_vl_model import build_tiny_vl_model
from slime.utils.weight_transport import destroy_custom_process_group, init_custom_process_group
from tests.engine.server.test_weights import broadcast_update, post_in_background
from tests.helpers.vl_checkpoints import hf_log_probs, random_image

SAMPLING = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3}
TEXT = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}how many?<|im_end|>\n<|im_start|>assistant\n"

SENDER = r"""
import json, sys
import httpx, torch
from safetensors.torch import load_file
from slime.utils.weight_transport import serialize_named_tensors

url, checkpoint, mode = sys.argv[1:4]
weights = load_file(checkpoint)
if mode == "vision":  # the merger's last projection, in the checkpoint's (legacy) name, randomized
    torch.manual_seed(5)
    weights = {"visual.merger.mlp.2.weight": torch.randn_like(weights["visual.merger.mlp.2.weight"])}
elif mode == "renamed":  # every weight under the newer names a trainer's transformers model uses
    renames = (("model.", "model.language_model."), ("visual.", "model.visual."))
    weights = {next((new + k[len(old):] for old, new in renames if k.startswith(old)), k): v for k, v in weights.items()}
payload = {"serialized_named_tensors": [serialize_named_tensors(list(weights.items()))], "weight_version": mode}
response = httpx.post(url + "/update_weights_from_tensor", json=payload, timeout=120, trust_env=False)
print(json.dumps({"status": response.status_code, "body": response.json()}))
"""


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="module")
def vl_server(vl_checkpoint, tmp_path_factory):
    from slime.engine.server.launch import launch_server

    process = launch_server(vl_checkpoint, extra_args=["--dtype", "float32"],
                            log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def vl_client(vl_server):
    with httpx.Client(base_url=vl_server.url, timeout=120, trust_env=False) as http:
        yield http


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "shape.png"
    random_image(61, 97, seed=4).save(path)
    return path


def generate(client, **body):
    response = client.post("/generate", json={"sampling_params": SAMPLING, "return_logprob": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def log_probs(result):
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def test_image_data_forms_and_transformers(vl_client, vl_checkpoint, image_file):
    from transformers import AutoModelForImageTextToText

    png = image_file.read_bytes()
    b64 = base64.b64encode(png).decode()
    results = [generate(vl_client, text=TEXT, image_data=form) for form in
               (str(image_file), image_file.as_uri(), "data:image/png;base64," + b64, [b64])]
    processor = load_vl_processor(vl_checkpoint)
    ids = processor.tokenizer(TEXT)["input_ids"]
    expanded = processor.expand_input_ids(ids, [str(image_file)]).input_ids
    results += [generate(vl_client, input_ids=ids, image_data=[str(image_file)]),
                generate(vl_client, input_ids=expanded, image_data=[str(image_file)])]
    first = results[0]
    assert first["meta_info"]["prompt_tokens"] == len(expanded)
    for result in results[1:]:
        assert result["output_ids"] == first["output_ids"]
        assert log_probs(result) == pytest.approx(log_probs(first), abs=1e-5)
    model = AutoModelForImageTextToText.from_pretrained(vl_checkpoint, dtype=torch.float32).eval()
    expected = hf_log_probs(model, processor, ids, [str(image_file)], first["output_ids"])
    assert (torch.tensor(log_probs(first)) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("body, fragment", [
    ({"text": TEXT, "image_data": "/no/such.png"}, "/no/such.png"),
    ({"text": TEXT, "image_data": "data:image/png;base64," + base64.b64encode(b"junk").decode()}, "not a readable"),
    ({"text": TEXT}, "1 run"),  # a placeholder without its image
    ({"text": TEXT, "image_data": [3]}, "must be strings"),
])
def test_bad_image_requests_are_400s(vl_client, body, fragment):
    response = vl_client.post("/generate", json={"sampling_params": SAMPLING, **body})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text


def send_tensors(server, checkpoint, mode, tmp_path):
    import json

    out, err = tmp_path / f"{mode}.out", tmp_path / f"{mode}.err"
    repo_root = str(Path(__file__).resolve().parents[3])
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.call([sys.executable, "-c", SENDER, server.url, str(checkpoint), mode], stdout=stdout,
                               stderr=stderr, timeout=120, env={**os.environ, "PYTHONPATH": repo_root})
    assert code == 0, err.read_text()[-3000:]
    return json.loads(out.read_text().strip().splitlines()[-1])


def test_weight_updates_reach_the_vision_tower_on_every_route(vl_client, vl_server, vl_checkpoint, image_file,
                                                             tmp_path):
    request = {"text": TEXT, "image_data": str(image_file)}
    generate(vl_client, **request)
    original = generate(vl_client, **request)
    assert original["meta_info"]["cached_tokens"] > 0
    checkpoint_file = vl_checkpoint / "model.safetensors"

    sent = send_tensors(vl_server, checkpoint_file, "vision", tmp_path)
    assert sent["status"] == 200, sent
    changed = generate(vl_client, **request)
    assert changed["meta_info"]["cached_tokens"] == 0 and log_probs(changed) != pytest.approx(log_probs(original))
    assert send_tensors(vl_server, checkpoint_file, "renamed", tmp_path)["status"] == 200
    assert log_probs(generate(vl_client, **request)) == pytest.approx(log_probs(original), abs=1e-5)

    other = build_tiny_vl_model(vl_checkpoint.parent / "other", "qwen2_5_vl", seed=1)  # the allowed folder
    response = vl_client.post("/update_weights_from_disk", json={"model_path": str(other)})
    assert response.status_code == 200, response.text
    assert log_probs(generate(vl_client, **request)) != pytest.approx(log_probs(original))
    assert vl_client.post("/update_weights_from_disk", json={"model_path": str(vl_checkpoint)}).status_code == 200
    assert log_probs(generate(vl_client, **request)) == pytest.approx(log_probs(original), abs=1e-5)

    group_name, port, results = f"vl-{uuid.uuid4().hex[:8]}", find_free_port(), []
    init_body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                 "group_name": group_name, "backend": "gloo"}
    thread = post_in_background(vl_server.url, "/init_weights_update_group", init_body, results)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group_name)
    thread.join(60)
    assert results and results[0][0] == 200
    weights = load_file(str(checkpoint_file))
    torch.manual_seed(9)
    vision_patch = [("model.visual.patch_embed.proj.weight", torch.randn_like(weights["visual.patch_embed.proj.weight"]))]
    status, _ = broadcast_update(vl_server, group, group_name, vision_patch, "dist-1")
    assert status == 200
    assert log_probs(generate(vl_client, **request)) != pytest.approx(log_probs(original))
    status, _ = broadcast_update(vl_server, group, group_name, list(weights.items()), "dist-2")
    assert status == 200
    assert log_probs(generate(vl_client, **request)) == pytest.approx(log_probs(original), abs=1e-5)
    assert vl_client.post("/destroy_weights_update_group", json={"group_name": group_name}).status_code == 200
    destroy_custom_process_group(group)


def test_streaming_and_parallel_samples_with_an_image(vl_client, image_file):
    import json as json_lib

    whole = generate(vl_client, text=TEXT, image_data=str(image_file))
    with vl_client.stream("POST", "/generate", json={"text": TEXT, "image_data": str(image_file), "stream": True,
                                                     "sampling_params": SAMPLING, "return_logprob": True}) as response:
        assert response.status_code == 200
        events = [json_lib.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["output_ids"] == whole["output_ids"]
    samples = vl_client.post("/generate", json={"text": TEXT, "image_data": str(image_file), "return_logprob": True,
                                                "sampling_params": {**SAMPLING, "n": 3}}).json()
    assert len(samples) == 3 and samples[0]["output_ids"] == whole["output_ids"]  # sample 0 keeps the seed
    assert all(sample["meta_info"]["cached_tokens"] > 0 for sample in samples)  # the image's blocks are shared
