"""slime's agent tests (tests/test_agent/ in slime, copied here verbatim) import their helper as
`tests.test_agent._fakes`: that package name is made to point at this folder, where the helper sits beside them.

transformers is imported before test_agent_rollout_cpu.py is collected: that file puts a stub in its place when it is
not imported yet (slime's CPU CI lacks it), and the stub would break every later test of the session that uses
transformers.

Each test here runs in the environment variables the session started with: a module imported while collecting (the
coding_agent_rl example sets its CLIs' defaults, e.g. SLIME_AGENT_CODEX_WIRE_API) must not change what slime's
harness tests see as slime's defaults."""

import os
import sys
import types
from pathlib import Path

import pytest

SESSION_ENVIRONMENT = dict(os.environ)

if "tests.test_agent" not in sys.modules:
    _alias = types.ModuleType("tests.test_agent")
    _alias.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["tests.test_agent"] = _alias


def pytest_collect_file(file_path, parent):
    # plugin_contracts' own run (tests/compat/test_slime_plugin_contracts.py) wants its stubs, the real one not
    if file_path.name == "test_agent_rollout_cpu.py" and os.environ.get("SLIME_PLUGIN_CONTRACTS") != "1":
        import transformers  # noqa: F401


@pytest.fixture(autouse=True)
def _session_environment(monkeypatch):
    for name in set(os.environ) - set(SESSION_ENVIRONMENT):
        monkeypatch.delenv(name)
    for name, value in SESSION_ENVIRONMENT.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
