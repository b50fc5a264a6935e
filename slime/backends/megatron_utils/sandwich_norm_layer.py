"""GLM-4's decoder layer on megatron-core's local spec: "sandwich" norms, four RMSNorms per layer.

transformers' `Glm4DecoderLayer` normalises the attention output (`post_self_attn_layernorm`) and the MLP output
(`post_mlp_layernorm`) before each residual add, besides the usual input and pre-MLP norms; megatron-core 0.16.1's
`TransformerLayer` has no such submodules. `SandwichNormLayer` is a `TransformerLayer` with the two extra norms
(parameters `post_self_attn_layernorm.weight`, `post_mlp_layernorm.weight`, the HF names) applied inside its two
bias-dropout-add steps: x + norm(attention(input_norm(x))), then h + norm(mlp(pre_mlp_norm(h))). GLM-4 has no
output biases (megatron-core's `add_bias_linear` is off), so the norm sees the whole sublayer output.

Not a general post-norm layer: only what Glm4ForCausalLM computes.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer

from slime.backends.megatron_utils.norm import RMSNorm


class _NormedBiasDropoutAdd:
    """A layer's bias-dropout-add with the sublayer output normalised first."""

    def __init__(self, bias_dropout_add, norm):
        self.bias_dropout_add, self.norm = bias_dropout_add, norm

    def __call__(self, training: bool, fused: bool):
        add = self.bias_dropout_add(training, fused)

        def normed_add(output_with_bias, residual, dropout_prob):
            output, bias = output_with_bias
            assert bias is None, "GLM-4's sublayers have no output bias"
            return add((self.norm(output), None), residual, dropout_prob)

        return normed_add


class SandwichNormLayer(TransformerLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_self_attn_layernorm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.post_mlp_layernorm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attn_bda = _NormedBiasDropoutAdd(self.self_attn_bda, self.post_self_attn_layernorm)
        self.mlp_bda = _NormedBiasDropoutAdd(self.mlp_bda, self.post_mlp_layernorm)
