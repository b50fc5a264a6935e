# qwen2.5-3B model shape: slime's preset (THUDM/slime@624b824 scripts/models/qwen2.5-3B.sh) in Megatron's flag names.
# train.py checks the values against --hf-checkpoint's config.json; both backends build the model from that file.
# Usage: source scripts/models/qwen2.5-3B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2048
   --ffn-hidden-size 11008
   --num-attention-heads 16
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --group-query-attention
   --num-query-groups 2
   --vocab-size 151936
)
