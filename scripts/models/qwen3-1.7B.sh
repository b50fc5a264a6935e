# qwen3-1.7B model shape, slime's Megatron-style flags; train.py checks them against --hf-checkpoint's config.json.
# Usage: source scripts/models/qwen3-1.7B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --vocab-size 151936
   --rotary-base 1000000
   --norm-epsilon 1e-6
   --normalization RMSNorm
   --swiglu
   --disable-bias-linear
   --use-rotary-position-embeddings
   --qk-layernorm
)
