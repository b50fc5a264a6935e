"""slime's agent tests (tests/test_agent/ in slime, copied here verbatim) import their helper as
`tests.test_agent._fakes`: that package name is made to point at this folder, where the helper sits beside them."""

import sys
import types
from pathlib import Path

if "tests.test_agent" not in sys.modules:
    _alias = types.ModuleType("tests.test_agent")
    _alias.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["tests.test_agent"] = _alias

# slime's test_agent_rollout_cpu.py puts a stub `transformers` into sys.modules when none is imported yet (slime's CI
# for it has no transformers); here the real one is installed, and a stub would break every later test of the
# session: import the real one before that module is collected.
import transformers  # noqa: E402, F401
