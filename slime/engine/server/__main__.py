"""`python -m slime.engine.server`: the built-in engine's SGLang-compatible HTTP server (flags: server/config.py)."""

from slime.engine.server.app import main

main()
