"""The engine serving LoRA adapters unmerged (slime/engine/lora/) on a tiny Qwen3 in fp32 on the CPU: an adapter's
log-probs equal transformers with the adapter merged into its weights (float64), one step mixing two adapters and
the base model gives each request what it gets alone, the prefix cache never shares KV across adapters, and loading
and unloading many versions leaves the slots and memory flat."""

import gc
import weakref

import pytest
from transformers import AutoConfig

from slime.engine.engine import Engine
from slime.engine.lora.adapter import AdapterError, adapter_from_tensors
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.lora_adapters import merged_log_probs, random_adapter

PROMPTS = [[10 + i, 20, 30 + i, 40, 50, 60 + i, 70, 80, 90] for i in range(3)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.5)


@pytest.fixture(scope="module")
def hf_config(path):
    return AutoConfig.from_pretrained(str(path))


@pytest.fixture(scope="module")
def adapters(hf_config):
    """Two adapters of different ranks and targets."""
    return {"one": random_adapter(hf_config, rank=4, alpha=8, seed=1),
            "two": random_adapter(hf_config, rank=2, alpha=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))}


def make_engine(path, **config):
    config = {"max_loras_per_batch": 3, "num_kvcache_blocks": 256, **config}
    return Engine(str(path), device="cpu", kvcache_block_size=4, enable_lora=True, max_lora_rank=8, **config)


def load(engine, name, adapter):
    config, tensors = adapter
    return engine.load_lora_adapter(name, adapter_from_tensors(config, tensors.items(), engine.config.max_lora_rank))


def run_alone(engine, prompt, lora_name):
    rid = engine.add_request(prompt, GREEDY, incremental=False, lora_name=lora_name)
    while True:
        for output in engine.step():
            if output.rid == rid and output.finished:
                return {**output.to_dict(), "num_cached_tokens": output.num_cached_tokens}


@pytest.fixture(scope="module")
def engine(path, adapters):
    engine = make_engine(path)
    for name, adapter in adapters.items():
        load(engine, name, adapter)
    return engine


@pytest.mark.parametrize("name", ["one", "two", None])
def test_adapter_matches_merged_transformers(engine, path, adapters, name):
    config, tensors = adapters[name] if name else (None, None)
    for prompt in PROMPTS:
        output = run_alone(engine, prompt, name)
        expected = merged_log_probs(path, config, tensors, prompt + output["output_ids"], len(prompt))
        assert output["output_log_probs"] == pytest.approx(expected, abs=1e-4)
        if name is not None:  # the adapter changes the model clearly: the base scores these tokens differently
            base = merged_log_probs(path, None, None, prompt + output["output_ids"], len(prompt))
            assert max(abs(x - y) for x, y in zip(base, expected)) > 0.1


def test_mixed_batch_equals_each_request_alone(engine):
    names = ["one", "two", None]
    alone = {(i, name): run_alone(engine, prompt, name) for i, prompt in enumerate(PROMPTS) for name in names}
    engine.flush_cache()
    rids = {engine.add_request(prompt, GREEDY, incremental=False, lora_name=name): (i, name)
            for i, prompt in enumerate(PROMPTS) for name in names}
    finished = {}
    while len(finished) < len(rids):
        for output in engine.step():
            if output.finished:
                finished[rids[output.rid]] = output.to_dict()
    for key, output in finished.items():
        assert output["output_ids"] == alone[key]["output_ids"]
        assert output["output_log_probs"] == pytest.approx(alone[key]["output_log_probs"], abs=1e-5)
    # the three adapters' greedy continuations of one prompt are not all the same (the test can tell them apart)
    assert len({tuple(finished[(0, name)]["output_log_probs"]) for name in names}) == 3


def test_prefix_cache_is_not_shared_across_adapters(engine):
    prompt = list(range(100, 124))  # 6 full blocks of 4
    engine.flush_cache()
    first = run_alone(engine, prompt, "one")
    assert first["num_cached_tokens"] == 0
    assert run_alone(engine, prompt, "one")["num_cached_tokens"] == 20  # same adapter: the prompt's blocks hit
    other = run_alone(engine, prompt, "two")
    assert other["num_cached_tokens"] == 0
    base = run_alone(engine, prompt, None)
    assert base["num_cached_tokens"] == 0
    assert other["output_log_probs"] != pytest.approx(first["output_log_probs"], abs=1e-3)


def test_reloaded_name_does_not_reuse_old_kv(path, adapters):
    engine = make_engine(path)
    prompt = list(range(100, 124))
    load(engine, "policy", adapters["one"])
    first = run_alone(engine, prompt, "policy")
    engine.unload_lora_adapter("policy")
    load(engine, "policy", adapters["two"])
    again = run_alone(engine, prompt, "policy")
    assert again["num_cached_tokens"] == 0
    assert again["output_log_probs"] != pytest.approx(first["output_log_probs"], abs=1e-3)


def test_errors_name_the_problem(path, adapters, hf_config):
    engine = make_engine(path)
    with pytest.raises(AdapterError, match="unknown LoRA adapter 'nope'"):
        engine.add_request(PROMPTS[0], GREEDY, lora_name="nope")
    with pytest.raises(AdapterError, match="exceeds the engine's max_lora_rank=8"):
        load(engine, "big", random_adapter(hf_config, rank=16, alpha=16, seed=3))
    config, tensors = adapters["one"]
    bad = dict(tensors)
    name = next(n for n in bad if n.endswith("q_proj.lora_B.weight"))
    bad[name] = bad[name][:-1]
    with pytest.raises(AdapterError, match="do not fit the model's"):
        load(engine, "bad", (config, bad))
    renamed = {n.replace("q_proj", "qq_proj"): t for n, t in tensors.items()}
    with pytest.raises(AdapterError, match="is not a LoRA target of this model"):
        load(engine, "bad", (config, renamed))
    with pytest.raises(AdapterError, match="also adapts as a whole"):
        load(engine, "bad", random_adapter(hf_config, rank=2, alpha=2, seed=5, targets=("gate_proj", "gate_up_proj")))
    for i in range(3):
        load(engine, f"a{i}", adapters["two"])
    with pytest.raises(AdapterError, match="all 3 LoRA slots are in use"):
        load(engine, "a3", adapters["two"])
    with pytest.raises(AdapterError, match="already loaded"):
        engine.unload_lora_adapter("a0") or load(engine, "a1", adapters["two"])
    with pytest.raises(AdapterError, match="is not loaded"):
        engine.unload_lora_adapter("a0")
    assert engine.model_runner.lora_registry.loaded_slots == {1, 2}


def test_unloaded_adapter_keeps_serving_its_running_requests(path, adapters):
    engine = make_engine(path, max_loras_per_batch=1)
    load(engine, "v1", adapters["one"])
    expected = run_alone(engine, PROMPTS[0], "v1")
    rid = engine.add_request(PROMPTS[0], GREEDY, incremental=False, lora_name="v1")
    engine.step()  # the request is running with v1
    engine.unload_lora_adapter("v1")
    with pytest.raises(AdapterError, match="still used by running requests"):
        load(engine, "v2", adapters["two"])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.rid: o.to_dict() for o in engine.step() if o.finished})
    assert outputs[rid]["output_log_probs"] == pytest.approx(expected["output_log_probs"], abs=1e-5)
    load(engine, "v2", adapters["two"])  # the slot is free once the request finished


def test_many_versions_leave_slots_and_memory_flat(path, adapters, hf_config):
    engine = make_engine(path)
    lora = engine.model_runner.lora
    num_bytes = lora.num_bytes
    pushed = []  # weak references to every version's tensors: the engine copies them into its slots, keeps none
    for version in range(20):
        name = f"policy@{version}"
        config, tensors = random_adapter(hf_config, rank=4, alpha=8, seed=100 + version)
        pushed += [weakref.ref(tensor) for tensor in tensors.values()]
        load(engine, name, (config, tensors))
        del tensors
        run_alone(engine, PROMPTS[0], name)
        if version:
            engine.unload_lora_adapter(f"policy@{version - 1}")
        assert len(engine.model_runner.lora_registry.loaded_slots) == 1
    registry = engine.model_runner.lora_registry
    assert sorted(registry.adapters) == ["policy@19"] and sum(registry.num_requests) == 0
    assert lora.num_bytes == num_bytes
    gc.collect()
    assert not [ref for ref in pushed if ref() is not None]


def test_lora_routes_need_enable_lora(path, adapters):
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64)
    with pytest.raises(AdapterError, match="started without enable_lora"):
        engine.add_request(PROMPTS[0], GREEDY, lora_name="one")


@pytest.mark.parametrize("config", [{"overlap_schedule": True}, {"num_kvcache_blocks": 14},
                                    {"max_num_batched_tokens": 7}],
                         ids=["overlap", "preemption", "chunked-prefill"])
def test_mixed_adapters_survive_overlap_preemption_and_chunking(path, adapters, engine, config):
    """The same per-request results through the overlapped schedule, preemption by recompute (14 blocks of 4 for 9
    requests of 17 tokens) and chunked prefill."""
    names = ["one", "two", None]
    expected = {(i, name): run_alone(engine, prompt, name) for i, prompt in enumerate(PROMPTS) for name in names}
    other = make_engine(path, **config)
    for name, adapter in adapters.items():
        load(other, name, adapter)
    rids = {other.add_request(prompt, GREEDY, incremental=False, lora_name=name): (i, name)
            for i, prompt in enumerate(PROMPTS) for name in names}
    finished, num_preemptions = {}, 0
    while len(finished) < len(rids):
        finished.update({rids[o.rid]: o.to_dict() for o in other.step() if o.finished})
        num_preemptions = max([num_preemptions, *(s.num_preemptions for s in other.requests.values())])
    if "num_kvcache_blocks" in config:
        assert num_preemptions > 0
    for key, output in finished.items():
        assert output["output_ids"] == expected[key]["output_ids"]
        assert output["output_log_probs"] == pytest.approx(expected[key]["output_log_probs"], abs=1e-5)
    assert sum(other.model_runner.lora_registry.num_requests) == 0  # every request gave its slot back


def test_glm4_fused_gate_up_adapter_matches_merged_transformers(tmp_path):
    """GLM-4's checkpoint fuses gate/up itself (mlp.gate_up_proj): one adapter on the whole fused output."""
    glm = build_tiny_model(tmp_path / "glm4", arch="glm4", initializer_range=0.5)
    adapter = random_adapter(AutoConfig.from_pretrained(str(glm)), rank=4, alpha=8, seed=4,
                             targets=("q_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"))
    engine = make_engine(glm)
    load(engine, "glm", adapter)
    output = run_alone(engine, PROMPTS[0], "glm")
    expected = merged_log_probs(glm, *adapter, PROMPTS[0] + output["output_ids"], len(PROMPTS[0]))
    assert output["output_log_probs"] == pytest.approx(expected, abs=1e-4)
    base = merged_log_probs(glm, None, None, PROMPTS[0] + output["output_ids"], len(PROMPTS[0]))
    assert max(abs(x - y) for x, y in zip(base, expected)) > 0.1


def test_aborted_and_empty_requests_give_their_slot_back(path, adapters):
    engine = make_engine(path, max_loras_per_batch=1)
    load(engine, "v1", adapters["one"])
    registry = engine.model_runner.lora_registry
    rid = engine.add_request(PROMPTS[0], GREEDY, lora_name="v1")
    engine.add_request(PROMPTS[1], {**GREEDY, "max_new_tokens": 0}, lora_name="v1")  # finished at once
    engine.step()
    assert registry.num_requests == [1]
    engine.abort_request(rid)
    assert registry.num_requests == [0]
    engine.unload_lora_adapter("v1")
    load(engine, "v2", adapters["two"])  # the only slot is free again
