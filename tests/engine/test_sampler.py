"""Sampling and finish rules of the engine on a tiny Qwen3: SamplingParams validation, sampling_seed
reproducibility, top_k=1 == greedy, log-probs equal log_softmax(logits / T) recomputed by transformers, stop
strings, stop_token_ids, min_new_tokens, max_new_tokens, abort."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.engine.sampling_params import SamplingParams
from slime.utils.tiny_model import build_tiny_model

PROMPT = [10, 20, 30, 40, 50, 60, 70]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.2)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=256, seed=1)
    return engine, hf


def greedy(engine, n=30, **params):
    return engine.generate([PROMPT], {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **params})[0]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temprature": 1.0}, "temprature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"sampling_seed": 1.5}, "sampling_seed"),
    ],
)
def test_sampling_params_errors_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)


def test_sampling_params_defaults_and_stop_string():
    params = SamplingParams.from_dict({"stop": "###", "top_k": 5})
    assert params.stop == ["###"] and params.top_k == 5 and params.temperature == 1.0
    assert params.max_new_tokens == 128 and params.min_new_tokens == 0 and params.sampling_seed is None


def test_sampling_seed_is_reproducible_across_batches(setup):
    engine, _ = setup
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 1234}
    alone = engine.generate([PROMPT], params)[0]
    others = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}
    batched = engine.generate([PROMPT[:3], PROMPT, PROMPT[2:]], [others, params, others])[1]
    assert batched["output_ids"] == alone["output_ids"]
    assert batched["output_log_probs"] == pytest.approx(alone["output_log_probs"], abs=1e-5)
    other_seed = engine.generate([PROMPT], {**params, "sampling_seed": 99})[0]
    assert other_seed["output_ids"] != alone["output_ids"]
    unseeded = engine.generate([PROMPT] * 2, others)
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


def test_top_k_1_equals_greedy(setup):
    engine, _ = setup
    reference = greedy(engine)
    top1 = engine.generate([PROMPT], {"temperature": 1.0, "top_k": 1, "max_new_tokens": 30, "ignore_eos": True})[0]
    assert top1["output_ids"] == reference["output_ids"]
    assert top1["output_log_probs"] == pytest.approx(reference["output_log_probs"], abs=1e-5)


@pytest.mark.parametrize(
    "params, temperature",
    [
        ({"temperature": 0.7, "top_p": 0.9, "top_k": 20}, 0.7),
        ({"temperature": 1.3, "min_p": 0.05}, 1.3),
        ({"temperature": 0.0}, 1.0),
    ],
)
def test_log_probs_equal_transformers_log_softmax(setup, params, temperature):
    engine, hf = setup
    output = engine.generate([PROMPT], {**params, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 7})[0]
    tokens = PROMPT + output["output_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(output["output_ids"])[:, None])
    assert torch.tensor(output["output_log_probs"]) == pytest.approx(expected.squeeze(1), abs=1e-4)
    assert len(set(output["output_ids"])) > 3


def test_filters_restrict_the_sampled_set(setup):
    engine, hf = setup
    output = engine.generate([PROMPT], {"temperature": 1.0, "top_k": 3, "max_new_tokens": 40, "ignore_eos": True})[0]
    tokens = PROMPT + output["output_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, len(PROMPT) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(token in top3[i].tolist() for i, token in enumerate(output["output_ids"]))


def test_stop_string_finishes_and_trims(setup):
    engine, _ = setup
    full = greedy(engine)
    text = full["text"]
    stop = engine.tokenizer.decode(full["output_ids"][12:14])
    assert stop.strip() and text.find(stop) >= 0
    stopped = greedy(engine, stop=[stop])
    assert stopped["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[: text.find(stop)]
    assert stopped["output_ids"] == full["output_ids"][: len(stopped["output_ids"])]
    kept = greedy(engine, stop=[stop], no_stop_trim=True)
    assert stop in kept["text"] and kept["text"] == engine.tokenizer.decode(kept["output_ids"])


def test_stop_token_ids_and_min_new_tokens(setup):
    engine, _ = setup
    ids = greedy(engine)["output_ids"]
    index = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop_token = ids[index]
    stopped = greedy(engine, stop_token_ids=[stop_token])
    assert stopped["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert stopped["output_ids"] == ids[: index + 1]
    assert stopped["text"] == engine.tokenizer.decode(ids[:index])
    delayed = greedy(engine, n=40, stop_token_ids=[stop_token], min_new_tokens=index + 2)
    assert stop_token not in delayed["output_ids"][: index + 2]
    assert delayed["completion_tokens"] > index + 2 or delayed["finish_reason"]["type"] == "length"
    assert delayed["output_ids"][:index] == ids[:index]


def test_max_new_tokens_finishes_with_length(setup):
    engine, _ = setup
    output = engine.generate([PROMPT], {"max_new_tokens": 5, "ignore_eos": True})[0]
    assert output["finish_reason"] == {"type": "length", "length": 5} and output["completion_tokens"] == 5
    empty = engine.generate([PROMPT], {"max_new_tokens": 0})[0]
    assert empty["output_ids"] == [] and empty["finish_reason"] == {"type": "length", "length": 0}


def test_abort_returns_partial_output_and_frees_blocks(setup):
    engine, _ = setup
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True))
    other = engine.add_request(PROMPT[:4], SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(4):
        outputs = engine.step()
    running = next(o for o in outputs if o.rid == rid)
    assert not running.finished and running.finish_reason is None
    assert running.text == engine.tokenizer.decode(running.output_token_ids)
    output = engine.abort_request(rid)
    assert output.finished and output.finish_reason["type"] == "abort"
    expected = greedy(engine, n=4)
    assert output.output_token_ids == expected["output_ids"]
    assert output.output_log_probs == pytest.approx(expected["output_log_probs"], abs=1e-5)
    assert engine.abort_request(rid) is None
    assert [o.rid for o in engine.abort_all()] == [other]
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generate_accepts_strings(setup):
    engine, _ = setup
    outputs = engine.generate(["What is 12 + 7?", "The quick brown fox"], SamplingParams(max_new_tokens=3))
    assert [o["prompt_tokens"] for o in outputs] == [
        len(engine.tokenizer("What is 12 + 7?")["input_ids"]),
        len(engine.tokenizer("The quick brown fox")["input_ids"]),
    ]
    with pytest.raises(ValueError, match="sampling_params"):
        engine.generate(["a", "b"], [{}, {}, {}])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([10**6], SamplingParams())


def test_a_step_leaves_finished_texts_to_the_consumer(setup):
    """The engine's step does not decode a finished request's text: each output carries it pending, read alone
    or decoded with the others in one batch (what the server's event loop does), the same trimmed final text."""
    from slime.engine.stop_strings import FinalText, decode_final_texts

    engine, _ = setup
    ids = greedy(engine)["output_ids"]
    stop = engine.tokenizer.decode(ids[12:14])
    cases = [{"stop": [stop]}, {"stop_token_ids": [ids[5]]}, {"max_new_tokens": 9},
             {"stop": [stop], "skip_special_tokens": False}]
    expected = [greedy(engine, **case)["text"] for case in cases]  # Engine.generate: the batch path
    for case in cases:
        engine.add_request(PROMPT, SamplingParams(**{"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True,
                                                     **case}))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(output for output in engine.step() if output.finished)
    assert len(outputs) == len(cases)
    assert all(isinstance(output.pending_detokenize, FinalText) for output in outputs)
    alone = [output.pending_detokenize(output.output_token_ids) for output in outputs]
    decode_final_texts(outputs)
    assert all(output.pending_detokenize is None for output in outputs)
    by_request = sorted(range(len(outputs)), key=lambda i: outputs[i].rid)
    assert [outputs[i].text for i in by_request] == [alone[i] for i in by_request]
    assert sorted(output.text for output in outputs) == sorted(expected)
    assert expected[0] == expected[3] and stop not in expected[0] and len(set(expected)) == 3


def test_final_texts_of_a_batch_equal_one_by_one_decoding(setup):
    """Requests finishing in the same step are decoded in one batched call: the same texts as decoding each alone,
    with each request's own stop trimming and skip_special_tokens."""
    from types import SimpleNamespace

    from slime.engine.stop_strings import decode_many, final_texts

    engine, _ = setup
    tokenizer = engine.tokenizer
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = [list(range(40, 70)) + [special, 75], list(range(80, 95)), [special, 101, 102, special], [7]]
    assert decode_many(tokenizer, outputs, True) == [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    assert decode_many(tokenizer, outputs, False) == [tokenizer.decode(o, skip_special_tokens=False) for o in outputs]
    cut_at = tokenizer.decode(outputs[1][5:7])
    seqs = [
        SimpleNamespace(output_token_ids=outputs[0], finish_reason={"type": "length"},
                        sampling_params=SamplingParams(skip_special_tokens=False)),
        SimpleNamespace(output_token_ids=outputs[1], finish_reason={"type": "stop", "matched": cut_at},
                        sampling_params=SamplingParams(stop=[cut_at])),
        SimpleNamespace(output_token_ids=outputs[2], finish_reason={"type": "stop", "matched": special},
                        sampling_params=SamplingParams(stop_token_ids=[special], skip_special_tokens=False)),
        SimpleNamespace(output_token_ids=outputs[3], finish_reason={"type": "stop", "matched": 7},
                        sampling_params=SamplingParams(stop_token_ids=[7], no_stop_trim=True)),
    ]
    full_1 = tokenizer.decode(outputs[1])
    assert final_texts(tokenizer, seqs) == [
        tokenizer.decode(outputs[0], skip_special_tokens=False),
        full_1[: full_1.rfind(cut_at)],
        tokenizer.decode(outputs[2][:-1], skip_special_tokens=False),
        tokenizer.decode(outputs[3]),
    ]
