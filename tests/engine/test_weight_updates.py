"""Weight updates (from tensors and from disk), versioning, prefix-cache flushing and hit accounting, bad-weight
errors, and release / resume of memory, on a tiny Qwen2 engine checked against transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine, EngineMemoryReleasedError
from slime.engine.memory_tags import EngineWeightsMissingError
from slime.engine.models.weight_loader import iterate_checkpoint
from slime.engine.sampling_params import SamplingParams
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.greedy_margin import assert_clear_greedy_margin

PROMPT = list(range(30, 52))  # 22 tokens: 5 full blocks of 4 can be shared
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    first = build_tiny_model(tmp_path_factory.mktemp("first"), arch="qwen2", initializer_range=0.2, seed=0)
    second = build_tiny_model(tmp_path_factory.mktemp("second"), arch="qwen2", initializer_range=0.2, seed=1)
    return first, second


@pytest.fixture
def engine(paths):
    return Engine(str(paths[0]), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64)


def hf_greedy(path_or_model, prompt=PROMPT, n=16):
    hf = path_or_model
    if not isinstance(hf, torch.nn.Module):
        hf = AutoModelForCausalLM.from_pretrained(str(path_or_model), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    output = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    output_ids = output[0, len(prompt) :].tolist()
    assert_clear_greedy_margin(hf, prompt, output_ids)
    return output_ids


def test_n_samples_report_shared_prefix_as_cached(engine):
    outputs = engine.generate([PROMPT] * 4, {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True})
    assert [o["cached_tokens"] for o in outputs] == [0, 20, 20, 20]
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again["cached_tokens"] == 20


def test_update_from_tensors_changes_outputs_version_and_flushes_cache(engine, paths):
    before = engine.generate([PROMPT], GREEDY)[0]
    assert before["weight_version"] == "0"
    assert before["output_ids"] == hf_greedy(paths[0])
    assert engine.generate([PROMPT], GREEDY)[0]["cached_tokens"] == 20

    hf = AutoModelForCausalLM.from_pretrained(str(paths[0]), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "mlp" in name or "embed" in name:
                param.mul_(-1.5)
    engine.update_weights_from_tensors(list(hf.state_dict().items()))
    after = engine.generate([PROMPT], GREEDY)[0]
    assert after["weight_version"] == engine.weight_version == "1"
    assert after["cached_tokens"] == 0
    assert after["output_ids"] != before["output_ids"]
    assert after["output_ids"] == hf_greedy(hf)

    engine.update_weights_from_tensors([("model.norm.weight", hf.model.norm.weight * 2)], weight_version="v7")
    assert engine.weight_version == "v7"
    assert engine.generate([PROMPT], GREEDY)[0]["cached_tokens"] == 0


def test_update_from_disk(engine, paths):
    engine.generate([PROMPT], GREEDY)
    engine.update_weights_from_disk(str(paths[1]))
    output = engine.generate([PROMPT], GREEDY)[0]
    assert output["output_ids"] == hf_greedy(paths[1])
    assert output["cached_tokens"] == 0 and output["weight_version"] == "1"
    engine.update_weights_from_disk(str(paths[0]), weight_version="restored")
    assert engine.generate([PROMPT], GREEDY)[0]["output_ids"] == hf_greedy(paths[0])


@pytest.mark.parametrize(
    "name, shape, match",
    [
        ("model.layers.0.self_attn.q_proj.weight", (3, 3), "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.9.mlp.up_proj.weight", (128, 64), "unknown weight 'model.layers.9.mlp.up_proj.weight'"),
        ("model.decoder.foo", (4,), "unknown weight 'model.decoder.foo'"),
    ],
)
def test_bad_weights_are_rejected_by_name_and_leave_model_intact(engine, name, shape, match):
    before = engine.generate([PROMPT], GREEDY)[0]
    good = ("model.norm.weight", torch.zeros(64))
    with pytest.raises(ValueError, match=match):
        engine.update_weights_from_tensors([good, (name, torch.zeros(shape))])
    assert engine.weight_version == "0"
    assert engine.generate([PROMPT], GREEDY)[0]["output_ids"] == before["output_ids"]


def test_release_and_resume_memory(engine):
    before = engine.generate([PROMPT], GREEDY)[0]
    engine.release_memory(["weights", "kv_cache", "cuda_graph"])
    assert not engine.model_runner.has_kv_cache
    assert all(p.numel() == 0 for p in engine.model_runner.model.parameters())
    with pytest.raises(EngineMemoryReleasedError, match="resume_memory"):
        engine.generate([PROMPT], GREEDY)
    with pytest.raises(EngineMemoryReleasedError):
        engine.update_weights_from_tensors([])
    with pytest.raises(EngineMemoryReleasedError):
        engine.add_request(PROMPT, SamplingParams())
    engine.resume_memory(["weights", "kv_cache", "cuda_graph"])
    after = engine.generate([PROMPT], GREEDY)[0]
    assert after["output_ids"] == before["output_ids"]
    assert after["output_log_probs"] == before["output_log_probs"]
    assert after["cached_tokens"] == 0  # the prefix cache was flushed with the KV cache
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory(["gpu"])


def test_release_discarding_weights_refuses_to_generate_until_a_full_push_lands(engine, paths):
    fresh = Engine(str(paths[1]), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64)
    expected = fresh.generate([PROMPT], GREEDY)[0]
    assert expected["output_ids"] != engine.generate([PROMPT], GREEDY)[0]["output_ids"]
    engine.release_memory(["weights", "kv_cache", "cuda_graph"], discard_weights=True)
    assert engine.model_runner.host_weights.buffers is None  # nothing copied out
    engine.resume_memory(["weights"])
    storage = {p.untyped_storage().data_ptr() for p in engine.model_runner.model.parameters()}
    assert len(storage) == 1  # one allocation for all (one dtype)
    engine.resume_memory(["kv_cache", "cuda_graph"])
    with pytest.raises(EngineWeightsMissingError, match="discard_weights"):
        engine.generate([PROMPT], GREEDY)
    pushed = dict(iterate_checkpoint(paths[1]))
    first, rest = list(pushed.items())[:1], list(pushed.items())[1:]
    engine.update_weights_from_tensors(first, weight_version="1")  # a first bucket: still incomplete
    with pytest.raises(EngineWeightsMissingError, match=f"{len(engine.named_weight_shapes()) - 1} are not loaded"):
        engine.add_request(PROMPT, SamplingParams())
    engine.update_weights_from_tensors(rest, weight_version="1")
    after = engine.generate([PROMPT], GREEDY)[0]
    assert after["output_ids"] == expected["output_ids"]
    assert after["output_log_probs"] == pytest.approx(expected["output_log_probs"], abs=1e-5)
    # A later saving release keeps the pushed weights (host copy of the views).
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    assert engine.generate([PROMPT], GREEDY)[0]["output_ids"] == expected["output_ids"]
    with pytest.raises(ValueError, match="'weights' tag"):
        engine.release_memory(["kv_cache"], discard_weights=True)


def test_release_mid_generation_recomputes_on_resume(engine):
    expected = engine.generate([PROMPT], GREEDY)[0]
    rid = engine.add_request(PROMPT, SamplingParams(**GREEDY))
    for _ in range(5):
        engine.step()
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.rid == rid and o.finished]
    assert outputs[0].output_token_ids == expected["output_ids"]
    assert outputs[0].output_log_probs == pytest.approx(expected["output_log_probs"], abs=1e-5)


def test_a_tied_lm_head_pushed_by_its_own_name_completes_the_discarded_weights(tmp_path):
    # tie_word_embeddings: the engine names the shared matrix model.embed_tokens.weight; a sender that pushes it as
    # lm_head.weight loads the same tensor, and must count as having pushed it.
    path = build_tiny_model(tmp_path / "tied", arch="qwen3", seed=2, tie_word_embeddings=True)
    engine = Engine(str(path), device="cpu")
    expected = engine.generate([PROMPT], GREEDY)[0]["output_ids"]
    engine.release_memory(discard_weights=True)
    engine.resume_memory()
    pushed = [("lm_head.weight" if name == "model.embed_tokens.weight" else name, tensor)
              for name, tensor in iterate_checkpoint(path) if name != "lm_head.weight"]
    engine.update_weights_from_tensors(pushed)
    assert not engine.weights_missing
    assert engine.generate([PROMPT], GREEDY)[0]["output_ids"] == expected


def test_a_discarding_release_after_a_saving_one_is_a_no_op_for_moe(tmp_path):
    # The supervisor releases a restarted engine (saving) before the loop's release with discard_weights reaches it:
    # the second release must not read the released (empty) expert tensors, and the weights stay the saved ones.
    path = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=3)
    engine = Engine(str(path), device="cpu")
    expected = engine.generate([PROMPT], GREEDY)[0]["output_ids"]
    engine.release_memory()
    engine.release_memory(discard_weights=True)
    engine.resume_memory()
    assert not engine.weights_missing
    assert engine.generate([PROMPT], GREEDY)[0]["output_ids"] == expected
