"""`python -m slime.engine.server`: the built-in engine's SGLang-compatible HTTP server (flags: server/config.py)."""

from slime.engine.server.app import main

if __name__ == "__main__":  # a sharded engine's ranks are spawned: they import this module without running it
    main()
