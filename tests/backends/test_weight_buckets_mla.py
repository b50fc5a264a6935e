"""Weight buckets for real SGLang's DeepSeek loader: q_a_proj and kv_a_proj_with_mqa of a layer always travel in one
bucket (SGLang fuses them only when both arrive in one load_weights call), whatever the bucket size; every other
boundary stays where the size puts it, and a model without q_a_proj (Moonlight) is bucketed as before."""

import pytest
import torch

from slime.backends.push_pipeline import iter_buckets

MLA_LAYER = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
             "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]


def _names(layers: int, attention: list[str]) -> list[tuple[str, torch.Tensor]]:
    named = [("model.embed_tokens.weight", torch.zeros(64))]
    for layer in range(layers):
        named += [(f"model.layers.{layer}.self_attn.{name}", torch.zeros(16)) for name in attention]
        named.append((f"model.layers.{layer}.mlp.down_proj.weight", torch.zeros(16)))
    return named


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 150, 10_000])
def test_q_a_and_kv_a_share_a_bucket_at_every_size(bucket_bytes):
    named = _names(3, MLA_LAYER)
    buckets = list(iter_buckets(named, bucket_bytes))
    assert [name for bucket, _ in buckets for name, _ in bucket] == [name for name, _ in named]
    assert [last for _, last in buckets] == [False] * (len(buckets) - 1) + [True]
    where = {name: index for index, (bucket, _) in enumerate(buckets) for name, _ in bucket}
    for layer in range(3):
        prefix = f"model.layers.{layer}.self_attn."
        assert where[prefix + "q_a_proj.weight"] == where[prefix + "kv_a_proj_with_mqa.weight"]
    if bucket_bytes == 1:  # every tensor alone but the pair and the two between them: one bucket of 4 per layer
        assert len(buckets) == len(named) - 3 * 3


def test_without_q_a_proj_buckets_are_cut_by_size_only():
    moonlight = ["q_proj.weight", *MLA_LAYER[3:]]
    named = _names(2, moonlight)
    assert len(list(iter_buckets(named, 1))) == len(named)
