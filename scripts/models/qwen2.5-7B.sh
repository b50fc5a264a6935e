# qwen2.5-7B model shape, slime's Megatron-style flags; train.py checks them against --hf-checkpoint's config.json.
# Usage: source scripts/models/qwen2.5-7B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --vocab-size 152064
   --rotary-base 1000000
   --norm-epsilon 1e-6
   --normalization RMSNorm
   --swiglu
   --disable-bias-linear
   --use-rotary-position-embeddings
   --add-qkv-bias
   --untie-embeddings-and-output-weights
)
