"""Not SGLang: the function-call parser names slime's tau-bench example imports (see ../README.md)."""
