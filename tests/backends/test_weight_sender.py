"""Weight push protocol of the FSDP trainer into the REAL engine server (tiny Qwen3, CPU), both the tensor-handle
and the gloo-broadcast path: every parameter arrives under its HF name with the trainer's values, in buckets whose
last one alone carries flush_cache true and the weight version.

The engine starts from a checkpoint of another seed than the trainer's, so before the push it disagrees with the
trainer in every parameter. After the push its log-probs of a fixed sequence equal the trainer's (through
transformers) within 1e-4, and for every single parameter we check that leaving it stale would break that match by
far more than 1e-4: so the match proves that each parameter arrived. What the trainer sends is recorded by
pass-through spies on its own send functions (every request still reaches the engine).
test_fsdp_update_weights.py covers repeated pushes across training steps.
"""

import httpx
import pytest
import torch
import torch.distributed as dist

from slime.backends import weight_sender as update_weight
from slime.engine.server.launch import launch_server
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.fsdp_helpers import full_params, make_args, make_train_data, make_trainer

ENGINE_SEED, TRAINER_SEED = 9, 8
PROMPT = list(range(3, 51))  # 48 tokens: 3 full KV blocks of 16, so a repeated prompt hits the prefix cache
SAMPLING = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3}
UPDATE_PATHS = ("/update_weights_from_tensor", "/update_weights_from_distributed")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(engine checkpoint, trainer checkpoint): same architecture, no parameter alike. Random init leaves every
    norm weight at 1.0 in both, so the engine's norms are drawn around 1 instead."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("weight_push")
    engine_checkpoint = build_tiny_model(root / "engine", arch="qwen3", seed=ENGINE_SEED)
    generator = torch.Generator().manual_seed(ENGINE_SEED)
    for file in engine_checkpoint.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if "norm" in name:
                tensors[name] = (1 + 0.5 * torch.randn(tensor.shape, generator=generator)).to(tensor.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    return engine_checkpoint, build_tiny_model(root / "trainer", arch="qwen3", seed=TRAINER_SEED)


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("weight_push_engine") / "engine.log"
    server = launch_server(checkpoints[0], extra_args=["--device", "cpu"], log_path=log,
                           env={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()


@pytest.fixture
def trainers():
    made = []

    def make(*args, **kwargs):
        made.append(make_trainer(make_args(*args, **kwargs)))
        return made[-1]

    yield make
    for trainer in made:
        if trainer.weight_updater.group is not None:  # let the engine drop its end of the broadcast group
            trainer.weight_updater.connect([], "tensor")
    if dist.is_initialized():
        dist.destroy_process_group()


def _get(url, path):
    response = httpx.get(url + path, timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def _post(url, path, payload):
    response = httpx.post(url + path, json=payload, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def _generate(url):
    meta = _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": SAMPLING})
    meta = meta["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]], meta


def _checkpoint_tensors(path):
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _reference_log_probs(model, params, tokens, response_length):
    """log_softmax at each response token of `model` run with `params` (HF names) through transformers."""
    with torch.no_grad():
        logits = torch.func.functional_call(model, params, (torch.tensor([tokens]),)).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return torch.stack([log_probs[p - 1, tokens[p]] for p in range(len(tokens) - response_length, len(tokens))])


@pytest.mark.parametrize("mode,device", [
    ("tensor", "cpu"),
    ("distributed", "cpu"),
    pytest.param("tensor", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_weight_push_delivers_every_parameter(engine, checkpoints, trainers, monkeypatch, mode, device):
    from transformers import AutoModelForCausalLM

    url = engine.url
    engine_checkpoint, trainer_checkpoint = checkpoints
    # The engine back on its own checkpoint (an earlier case may have pushed into it): known stale values.
    _post(url, "/update_weights_from_disk", {"model_path": str(engine_checkpoint), "weight_version": "stale"})
    info = _get(url, "/get_model_info")
    assert info["weight_version"] == "stale" and info["model_type"] == "qwen3"
    _generate(url)
    *_, warm = _generate(url)
    assert warm["cached_tokens"] > 0 and warm["weight_version"] == "stale"  # the prompt's blocks are cached

    trainer = trainers(trainer_checkpoint, "--lr", "1e-2", "--update-weight-buffer-size", "40000", device=device)
    trainer.train(0, make_train_data(4, vocab_size=300, seed=1))
    expected = {name.removeprefix("hf_model."): value.cpu() for name, value in full_params(trainer).items()}
    stale = {name: tensor for name, tensor in _checkpoint_tensors(engine_checkpoint).items() if name in expected}
    assert sorted(stale) == sorted(expected)  # the trainer has exactly the engine's weights (lm_head is tied)

    # Pass-through spies: what each request carried, and the engine's version right after it was answered.
    sent, bucket_names = [], []
    real_post, real_serialize = update_weight._post, update_weight.serialize_named_tensors

    def recording_post(engine_url, path, payload, headers=None):
        result = real_post(engine_url, path, payload, headers)
        if path in UPDATE_PATHS:
            sent.append({"path": path, "names": payload.get("names"), "flush_cache": payload["flush_cache"],
                         "weight_version": payload.get("weight_version"),
                         "version_after": _get(engine_url, "/get_weight_version")["weight_version"]})
        return result

    def recording_serialize(named_tensors):
        bucket_names.append([name for name, _ in named_tensors])
        return real_serialize(named_tensors)

    monkeypatch.setattr(update_weight, "_post", recording_post)
    monkeypatch.setattr(update_weight, "serialize_named_tensors", recording_serialize)
    version = f"7-{mode}-{device}"
    timings = trainer.update_weights([url], weight_version=version, mode=mode)

    assert {e["path"] for e in sent} == {f"/update_weights_from_{'tensor' if mode == 'tensor' else 'distributed'}"}
    names = bucket_names if mode == "tensor" else [e["names"] for e in sent]
    assert timings.num_buckets == len(sent) == len(names) > 2
    assert timings.bytes == sum(v.numel() * v.element_size() for v in expected.values())
    assert sorted(n for bucket in names for n in bucket) == sorted(expected)  # each parameter once
    assert [e["flush_cache"] for e in sent] == [False] * (len(sent) - 1) + [True]
    assert [e["weight_version"] for e in sent] == [None] * (len(sent) - 1) + [version]
    # The engine takes the new version from the last bucket only (it auto-numbers unversioned updates).
    assert all(e["version_after"] not in (version, "stale") for e in sent[:-1])
    assert sent[-1]["version_after"] == version == _get(url, "/get_model_info")["weight_version"]

    output_ids, engine_log_probs, meta = _generate(url)
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == version  # KV of the old weights is gone
    model = AutoModelForCausalLM.from_pretrained(trainer_checkpoint, dtype=torch.float32).eval()
    tokens = PROMPT + output_ids
    trained = _reference_log_probs(model, expected, tokens, len(output_ids))
    torch.testing.assert_close(torch.tensor(engine_log_probs), trained, rtol=0, atol=1e-4)
    # Every parameter matters to that match: left stale, any one of them moves these log-probs by far more.
    for name in expected:
        one_stale = _reference_log_probs(model, {**expected, name: stale[name]}, tokens, len(output_ids))
        assert (one_stale - trained).abs().max() > 1e-3, f"{name} does not influence the checked log-probs"
