"""Tensor and expert parallelism inside one engine: the ranks' shared state (`state.py`), the sharded layers and the
rank processes that follow rank 0's step plan."""
