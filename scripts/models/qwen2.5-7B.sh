# qwen2.5-7B model shape: slime's preset (THUDM/slime@624b824 scripts/models/qwen2.5-7B.sh) in Megatron's flag names.
# train.py checks the values against --hf-checkpoint's config.json; both backends build the model from that file.
# Usage: source scripts/models/qwen2.5-7B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-06
   --rotary-base 1000000
   --vocab-size 152064
   --untie-embeddings-and-output-weights
)
