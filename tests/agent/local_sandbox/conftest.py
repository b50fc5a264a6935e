"""Local sandboxes need root on the host (user-id maps, cgroups): without it these tests are skipped, saying why."""

import pytest

from slime.agent.local_sandbox import local_sandbox_problems


def pytest_collection_modifyitems(config, items):
    problems = local_sandbox_problems()
    if not problems:
        return
    skip = pytest.mark.skip(reason="local sandbox unavailable here: " + "; ".join(problems))
    for item in items:
        if "tests/agent/local_sandbox" in str(item.fspath):
            item.add_marker(skip)
