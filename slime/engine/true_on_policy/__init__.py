"""`--true-on-policy-mode`: one batch-invariant implementation of the decoder that the engine and the trainers both
run, so the engine's log-probs of its sampled tokens equal the trainer's bit for bit (tile_ops.py, tile_decoder.py,
contract.py for what it covers, engine_path.py for the engine's side)."""
