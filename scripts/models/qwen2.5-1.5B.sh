# qwen2.5-1.5B model shape: slime's preset (THUDM/slime@624b824 scripts/models/qwen2.5-1.5B.sh) in Megatron's flag names.
# train.py checks the values against --hf-checkpoint's config.json; both backends build the model from that file.
# slime's values are Qwen2.5-Math-1.5B's (rope_theta 10000); Qwen2.5-1.5B(-Instruct) has rope_theta 1000000.
# Usage: source scripts/models/qwen2.5-1.5B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 1536
   --ffn-hidden-size 8960
   --num-attention-heads 12
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 10000
   --group-query-attention
   --num-query-groups 2
   --vocab-size 151936
)
