"""PEFT itself as the reference: a PEFT model built on the tiny Qwen3 (non-zero B), saved with save_pretrained,
loaded by the engine from that folder; PEFT's own unmerged forward (float64) reproduces the engine's log-probs, so
the engine reads PEFT's file format and scale as PEFT does (plain LoRA and rsLoRA)."""

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engine.engine import Engine
from slime.utils.tiny_model import build_tiny_model

PROMPT = [11, 25, 37, 42, 58, 63, 71, 89, 94, 100]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", initializer_range=0.5)


def peft_folder(path, folder, use_rslora: bool):
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules="all-linear", lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=use_rslora)
    torch.manual_seed(5)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(std=0.3)
    model.save_pretrained(str(folder))
    return folder


def peft_log_probs(path, folder, token_ids, num_prompt_tokens):
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    model = peft.PeftModel.from_pretrained(base, str(folder)).double().eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].double()
        with model.disable_adapter():
            base_logits = model(input_ids=torch.tensor([token_ids])).logits[0].double()
    picks = [(pos - 1, token_ids[pos]) for pos in range(num_prompt_tokens, len(token_ids))]
    log_probs, base_log_probs = torch.log_softmax(logits, -1), torch.log_softmax(base_logits, -1)
    return [log_probs[p, t].item() for p, t in picks], [base_log_probs[p, t].item() for p, t in picks]


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_reproduces_the_engines_log_probs(path, tmp_path, use_rslora):
    folder = peft_folder(path, tmp_path / "adapter", use_rslora)
    engine = Engine(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=64, enable_lora=True,
                    max_lora_rank=4, max_loras_per_batch=1)
    engine.load_lora_adapter_from_folder("peft", str(folder))
    rid = engine.add_request(PROMPT, GREEDY, incremental=False, lora_name="peft")
    output = next(o for _ in range(100) for o in engine.step() if o.rid == rid and o.finished).to_dict()
    expected, base = peft_log_probs(path, folder, PROMPT + output["output_ids"], len(PROMPT))
    assert output["output_log_probs"] == pytest.approx(expected, abs=1e-4)
    assert max(abs(x - y) for x, y in zip(expected, base)) > 0.1  # the adapter matters for these tokens
