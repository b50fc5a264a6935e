# glm4-9B model shape: slime's preset (THUDM/slime@624b824 scripts/models/glm4-9B.sh) in Megatron's flag names.
# train.py checks the values against --hf-checkpoint's config.json; both backends build the model from that file.
# The built-in engine serves GLM-4 (model_type glm4) at --tp-size 1 (docs/reference/model-support.md).
# Usage: source scripts/models/glm4-9B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --spec "slime_plugins.models.glm4" "get_glm_spec"
   --swiglu
   --num-layers 40
   --hidden-size 4096
   --ffn-hidden-size 13696
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 10000
   --vocab-size 151552
   --post-self-attn-layernorm
   --post-mlp-layernorm
   --rotary-interleaved
   --rotary-percent 0.5
   --no-rope-fusion
   --untie-embeddings-and-output-weights
)
