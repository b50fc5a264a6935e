"""Not SGLang (see ../../README.md)."""
