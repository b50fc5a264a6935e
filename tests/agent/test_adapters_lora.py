"""The agent adapters sample with the LoRA adapter of the moment: an OpenAI client's turns through OpenAIAdapter (and
the real router) reach a LoRA-enabled engine server with `lora_path`, asked at each turn; the trained log-probs are
the adapter's (a direct /generate naming it, and transformers with the adapter merged), not the base model's."""

import httpx
import openai
import pytest
from transformers import AutoConfig, AutoTokenizer

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.ray.router import RouterProcess, register_worker
from tests.agent.test_adapters import ServedApp, render, runs
from tests.helpers.lora_adapters import merged_log_probs, random_adapter, write_peft_folder

SERVER_ARGS = ["--device", "cpu", "--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "2"]
SEED = 77
USER = {"role": "user", "content": "What is 12 + 7?"}


@pytest.fixture(scope="module")
def adapter_name(server, tiny_qwen3, tmp_path_factory):
    config, tensors = random_adapter(AutoConfig.from_pretrained(str(tiny_qwen3)), rank=4, alpha=8, seed=5)
    folder = write_peft_folder(tmp_path_factory.mktemp("adapter"), config, tensors)
    reply = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "agent@1", "lora_path": str(folder)},
                       timeout=120, trust_env=False)
    assert reply.status_code == 200, reply.text
    return "agent@1", config, tensors


@pytest.fixture(scope="module")
def router(server):
    process = RouterProcess(policy="manual")
    register_worker(process.url, server.url)
    yield process
    process.shutdown()


def direct(router, prompt_ids, lora_path):
    body = {"input_ids": prompt_ids, "return_logprob": True, "lora_path": lora_path,
            "sampling_params": {"temperature": 1.0, "sampling_seed": SEED, "max_new_tokens": 6}}
    result = httpx.post(f"{router.url}/generate", json=body, headers=router.headers, timeout=120,
                        trust_env=False).json()
    return result["output_ids"], [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("adapter_class", [OpenAIAdapter, AnthropicAdapter])
def test_turns_sample_with_the_current_adapter(adapter_class, server, router, tiny_qwen3, adapter_name):
    name, config, tensors = adapter_name
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    current = {"lora_path": None}
    adapter = adapter_class(tokenizer=tokenizer, sglang_url=router.url, max_turns=3, headers=router.headers,
                            lora_path=lambda: current["lora_path"])
    served = ServedApp(adapter.app)
    try:
        adapter.open_session("s", sampling_defaults={"temperature": 1.0, "sampling_seed": SEED})
        if adapter_class is OpenAIAdapter:
            client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="s", max_retries=0)
            turn = lambda: client.chat.completions.create(model="tiny", messages=[USER], max_tokens=6)
        else:
            import anthropic

            client = anthropic.Anthropic(base_url=served.url, api_key="s", max_retries=0)
            turn = lambda: client.messages.create(model="tiny", messages=[USER], max_tokens=6)
        turn()  # the base model
        current["lora_path"] = name  # a push happened: the next turn asks for the new version
        turn()
        samples = served.call(adapter.finish_session("s"))
        # a session's own adapter (several adapters in a run: the sample's) wins over the adapter-wide one
        current["lora_path"] = None
        adapter.open_session("own", sampling_defaults={"temperature": 1.0, "sampling_seed": SEED},
                             lora_path=lambda: name)
        client = (openai.OpenAI(base_url=f"{served.url}/v1", api_key="own", max_retries=0)
                  if adapter_class is OpenAIAdapter else client.with_options(api_key="own"))
        turn()
        own = served.call(adapter.finish_session("own"))
    finally:
        served.close()
    prompt_ids = render(tokenizer, [USER])
    by_turn = {s.metadata["turn_indices"][0]: runs(s, 1)[0] for s in samples}
    for turn_index, lora_path in ((0, None), (1, name)):
        ids, log_probs = by_turn[turn_index]
        assert (ids, pytest.approx(log_probs, abs=1e-5)) == direct(router, prompt_ids, lora_path)
    own_ids, own_log_probs = runs(own[0], 1)[0]
    assert (own_ids, pytest.approx(own_log_probs, abs=1e-5)) == by_turn[1]
    # turn 1's log-probs are the adapter's: transformers with it merged (float64), not the base model's
    ids, log_probs = by_turn[1]
    with_adapter = merged_log_probs(tiny_qwen3, config, tensors, prompt_ids + ids, len(prompt_ids))
    base = merged_log_probs(tiny_qwen3, None, None, prompt_ids + ids, len(prompt_ids))
    assert log_probs == pytest.approx(with_adapter, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(with_adapter, base)) > 0.05
