"""A local stand-in for tau-bench's public API (see ../README.md): tau-bench is not on PyPI."""
