"""The model families `--true-on-policy-mode` covers and why it refuses the others: one table read by the flag
checks (slime/config/flags_on_policy.py, before anything starts) and by the engine and the trainers when they build
the model (slime/engine/true_on_policy/contract.py, which also checks the config fields)."""

from __future__ import annotations

COVERED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
_SHARED_EXPERT = ("Qwen2-MoE's shared expert and its sigmoid gate are not in the batch-invariant decoder (Qwen3-MoE "
                  "is)")
_MLA = "multi-head latent attention (DeepSeek MLA) is not in the batch-invariant decoder"
REFUSED_MODEL_TYPES = {
    "qwen2_moe": _SHARED_EXPERT,
    "glm4": "GLM-4's sandwich norms and interleaved partial RoPE are not in the batch-invariant decoder",
    "glm4_moe": "GLM-4.5's sigmoid-routed experts and partial RoPE are not in the batch-invariant decoder",
    "deepseek_v3": _MLA,
    "kimi_k2": _MLA,
    "glm4_moe_lite": _MLA,
    "qwen2_5_vl": "vision-language models (image embeddings, multimodal RoPE) are not in the batch-invariant decoder",
    "qwen3_vl": "vision-language models (image embeddings, multimodal RoPE) are not in the batch-invariant decoder",
}
FIX = "run without --true-on-policy-mode (measure the mismatch with --get-mismatch-metrics, correct it with --use-tis)"


def family_refusal(model_type: str | None) -> str | None:
    """Why the mode refuses `model_type` (a message naming it), or None for a covered family."""
    if model_type in COVERED_MODEL_TYPES:
        return None
    why = REFUSED_MODEL_TYPES.get(model_type, "this model family is not in the batch-invariant decoder")
    return (f"--true-on-policy-mode does not cover model_type {model_type!r}: {why}; covered model types: "
            f"{', '.join(COVERED_MODEL_TYPES)}; {FIX}")
