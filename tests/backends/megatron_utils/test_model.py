"""Megatron backend, one process (TP=1): HF -> Megatron -> HF round trip bit for bit for every supported family,
the Megatron forward over a packed THD batch equals the HF transformers forward per sample, and the vocab-parallel
log-probs / entropy equal log_softmax over the real vocabulary (padded columns excluded)."""

from __future__ import annotations

import pytest
import torch

from slime.utils.misc import find_free_port
from tests.helpers.megatron_helpers import build_megatron, make_megatron_args

pytest.importorskip("megatron.core")

MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def _build_checkpoint(path, arch: str):
    from slime.utils.tiny_model import build_tiny_model

    if arch != "qwen3_moe":
        # llama untied: both the output layer and the tied path are covered
        return build_tiny_model(path, arch=arch, tie_word_embeddings=arch != "llama", vocab_size=300)
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from slime.utils.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(path, None, vocab_size=300)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                            **MOE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    return _build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture
def megatron_model(checkpoint):
    """Per test: conftest destroys the default process group (and with it Megatron's groups) after each test."""
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    args = make_megatron_args(checkpoint)
    chunks, hf_config = build_megatron(args, 0, 1, find_free_port())
    yield checkpoint, chunks, hf_config
    destroy_model_parallel()


def test_hf_round_trip_is_bit_exact(megatron_model):
    from safetensors.torch import load_file

    from slime.backends.megatron_utils.hf_weights import iter_hf_weights

    checkpoint, chunks, hf_config = megatron_model
    original = load_file(str(checkpoint / "model.safetensors"))
    exported = dict(iter_hf_weights(chunks, hf_config))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def _packed_batch(vocab_size: int):
    from slime.backends.packing import pack_samples

    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (7, 12, 4)]
    return tokens, pack_samples(tokens, [3, 5, 2], [0, 1, 2])


def test_forward_equals_transformers(megatron_model):
    from transformers import AutoModelForCausalLM

    from slime.backends.megatron_utils.log_probs import output_weight
    from slime.backends.megatron_utils.micro_batches import thd_input

    checkpoint, chunks, hf_config = megatron_model
    tokens, micro_batch = _packed_batch(hf_config.vocab_size)
    inputs = thd_input(micro_batch, torch.device("cpu"), pad_multiple=1)
    chunks[0].eval()
    with torch.no_grad():
        # at TP=1 the model returns its final hidden states (log_probs.py); the logits are theirs times the head
        hidden = chunks[0](inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params)
        logits = hidden @ output_weight(chunks[0], hf_config.vocab_size).t()
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        reference = torch.cat([hf(torch.tensor(t)[None]).logits[0] for t in tokens])
    torch.testing.assert_close(logits[0], reference, rtol=0, atol=1e-5)


def test_vocab_parallel_log_probs_match_log_softmax(megatron_model):
    from slime.backends.megatron_utils.log_probs import vocab_parallel_log_probs_and_entropy

    _, _, hf_config = megatron_model
    vocab = hf_config.vocab_size
    padded = -(-vocab // 128) * 128
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, padded, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (6,), generator=generator)
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, targets, 0.7, vocab)
    reference = torch.log_softmax(logits[:, :vocab] / 0.7, dim=-1)
    torch.testing.assert_close(log_probs, reference.gather(1, targets[:, None]).squeeze(1))
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1))
    (log_probs.sum() + entropy.sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    ((reference.gather(1, targets[:, None]).sum()) - (reference.exp() * reference).sum()).backward()
    torch.testing.assert_close(grad, logits.grad)
    assert padded == vocab or grad[:, vocab:].abs().max() == 0
