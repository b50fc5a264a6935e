# qwen2.5-1.5B model shape, slime's Megatron-style flags; train.py checks them against --hf-checkpoint's config.json.
# Usage: source scripts/models/qwen2.5-1.5B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 1536
   --ffn-hidden-size 8960
   --num-attention-heads 12
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --vocab-size 151936
   --rotary-base 1000000
   --norm-epsilon 1e-6
   --normalization RMSNorm
   --swiglu
   --disable-bias-linear
   --use-rotary-position-embeddings
   --add-qkv-bias
)
