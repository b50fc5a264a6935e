"""LoRA adapters served unmerged by the built-in engine: y = W x + scale * B (A x) on the targeted linears, with
the requests of one step using different adapters (or none).

- `adapter.py`: one adapter as the engine receives it (PEFT names, config, validation; a PEFT folder or pushed
  tensors), with a float64 checksum per tensor.
- `targets.py`: which engine linear (and which output slice of a fused one) each Hugging Face module path names.
- `slots.py`: the stacked A/B buffers of `max_loras_per_batch` slots on every targeted linear and the batched
  computation (a forward hook adding the delta per segment of tokens sharing an adapter).
- `registry.py`: adapter names -> slots, the requests holding each, deferred freeing on unload.
- `engine_lora.py`: the Engine's load / unload / per-request resolution.
- HTTP routes: `slime/engine/server/lora_routes.py`.

Not the trainer's LoRA (slime.backends) and never a merge into the base weights.
"""
