"""return_routed_experts on a tiny Qwen3-MoE: the experts the engine reports for every position (prompt and
generated tokens but the last) are transformers' router top-k for the same tokens, through chunked prefill, decode
and prefix-cache hits; over real HTTP they arrive as SGLang's base64 int32 [len(tokens) - 1 - start_len, layers,
top_k]; asking a dense model or an engine without the flag is a clear error."""

import base64

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
# The k-th and (k+1)-th router probabilities of every token must differ by more than fp32 rounding between the two
# implementations, or either expert is a correct answer (see tests/helpers/greedy_margin.py for the same rule on tokens).
ROUTER_MARGIN = 1e-4


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", initializer_range=0.3)


def hf_router_top_k(hf, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), num_layers, top_k] expert ids of transformers' router, after checking no near-tie."""
    top_k = hf.config.num_experts_per_tok
    with torch.no_grad():
        router_logits = hf(torch.tensor([token_ids]), output_router_logits=True).router_logits
    layers = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        values, ids = probs.topk(top_k + 1, dim=-1)
        gap = (values[:, top_k - 1] - values[:, top_k]).min().item()
        assert gap > ROUTER_MARGIN, f"router near-tie (gap {gap:.1e}): change the prompt or the model seed"
        layers.append(ids[:, :top_k])
    return torch.stack(layers, dim=1).numpy()


def test_routed_experts_equal_transformers_router(moe_checkpoint):
    hf = AutoModelForCausalLM.from_pretrained(str(moe_checkpoint), dtype=torch.float32).eval()
    # Block size 4 and 6-token prefill chunks: the routing of one prompt is written over several steps and blocks.
    engine = Engine(str(moe_checkpoint), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64,
                    max_num_batched_tokens=6, enable_return_routed_experts=True)
    prompt = [(7 * i + 3) % 500 for i in range(13)]
    first = engine.generate([prompt], GREEDY)  # plain request: no routing asked, none returned
    assert "routed_experts" not in first[0]
    rid = engine.add_request(prompt, GREEDY, return_routed_experts=True)
    outputs = {}
    while rid not in outputs:
        outputs.update({output.rid: output for output in engine.step() if output.finished})
    output = outputs[rid]
    assert output.num_cached_tokens == 12  # three full blocks served by the prefix cache
    tokens = prompt + output.output_token_ids
    routed = output.routed_experts
    assert routed.dtype == np.int32 and routed.shape == (len(tokens) - 1, 2, 2)
    np.testing.assert_array_equal(routed, hf_router_top_k(hf, tokens[:-1]))
    assert len(np.unique(routed)) > 4  # the tokens really spread over the experts


def test_routing_request_needs_the_engine_flag(moe_checkpoint, tiny_qwen3):
    engine = Engine(str(moe_checkpoint), device="cpu", num_kvcache_blocks=16)
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        engine.add_request([1, 2, 3], GREEDY, return_routed_experts=True)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        Engine(str(tiny_qwen3), device="cpu", num_kvcache_blocks=16, enable_return_routed_experts=True)


def test_http_routed_experts_wire_format_and_start_len(moe_checkpoint, tmp_path):
    from slime.engine.server.launch import launch_server

    hf = AutoModelForCausalLM.from_pretrained(str(moe_checkpoint), dtype=torch.float32).eval()
    server = launch_server(moe_checkpoint, extra_args=["--enable-return-routed-experts", "--device", "cpu"],
                           log_path=tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as client:
            prompt = [11, 23, 5, 8, 42, 17, 99]
            body = {"input_ids": prompt, "sampling_params": GREEDY, "return_routed_experts": True}
            meta = client.post("/generate", json=body).json()["meta_info"]
            # Not asked (sglang-router drops the field): an engine started with the flag answers with the routing.
            plain = client.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY}).json()
            assert plain["meta_info"]["routed_experts"] == meta["routed_experts"]
            refused = client.post("/generate", json={**body, "return_routed_experts": False}).json()
            assert "routed_experts" not in refused["meta_info"]
            tokens = prompt + plain["output_ids"]
            rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, 2, 2)
            assert rows.shape[0] == len(tokens) - 1 and meta["routed_experts_start_len"] == 0
            np.testing.assert_array_equal(rows, hf_router_top_k(hf, tokens[:-1]))
            continued = client.post("/generate", json={**body, "routed_experts_start_len": 5}).json()["meta_info"]
            tail = np.frombuffer(base64.b64decode(continued["routed_experts"]), dtype=np.int32).reshape(-1, 2, 2)
            np.testing.assert_array_equal(tail, rows[5:])
            bad = client.post("/generate", json={**body, "routed_experts_start_len": 8})
            assert bad.status_code == 400 and "routed_experts_start_len" in bad.json()["error"]["message"]
            # A GRPO group as one request (sampling_params.n, as the default rollout sends it under R3): each
            # sample's routing is its own tokens'.
            sampled = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3, "n": 3}
            group = client.post("/generate", json={"input_ids": prompt, "sampling_params": sampled,
                                                   "return_routed_experts": True}).json()
            assert len(group) == 3 and len({tuple(out["output_ids"]) for out in group}) > 1
            for out in group:
                tokens = prompt + out["output_ids"]
                rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
                np.testing.assert_array_equal(rows.reshape(-1, 2, 2), hf_router_top_k(hf, tokens[:-1]))
    finally:
        server.stop()
