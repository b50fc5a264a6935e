# qwen3-0.6B model shape: slime's preset (THUDM/slime@624b824 scripts/models/qwen3-0.6B.sh) in Megatron's flag names.
# train.py checks the values against --hf-checkpoint's config.json; both backends build the model from that file.
# Usage: source scripts/models/qwen3-0.6B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 1024
   --ffn-hidden-size 3072
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 8
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
   --kv-channels 128
   --qk-layernorm
)
