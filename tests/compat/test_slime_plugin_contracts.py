"""slime's plugin contract tests (tests/slime_upstream/plugin_contracts/, verbatim), run as slime runs them: in a
fresh interpreter where their stubs stand in for ray, transformers and sglang_router, so every module they import
must import those lazily, where slime's do. Their stubs would replace the real packages for the rest of a pytest
session, so the suite's own collection skips that folder (conftest.py) and this test runs it in a subprocess."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = "tests/slime_upstream/plugin_contracts"

# Tests of slime's source text, not of its behaviour: each reads one of slime's own files by path and looks for the
# line that calls the hook. This project calls the same hooks with the same arguments from its own files
# (docs/migrating/slime-compat.md); the signature-and-call checks of the same file pass.
SOURCE_TEXT_TESTS = {
    "custom_rollout_log": "reads slime/observability/rollout_metrics.py (no such module here)",
    "custom_eval_rollout_log": "reads slime/observability/rollout_metrics.py (no such module here)",
    "custom_reward_post_process": "reads slime/ray/rollout.py for slime's attribute name of the hook",
    "custom_convert_samples_to_train_data": "reads slime/ray/rollout.py for slime's attribute name of the hook",
    "rollout_data_postprocess": "reads slime/backends/megatron_utils/actor.py (this project's is elsewhere)",
}


# After the run: whether ray / transformers / sglang_router are the stubs (modules made in memory, with no file).
RUN_AND_REPORT = """import sys, pytest
code = pytest.main(sys.argv[1:])
print("stub modules:", [m in sys.modules and not hasattr(sys.modules[m], "__file__")
                        for m in ("ray", "transformers", "sglang_router")])
raise SystemExit(code)"""


def test_slimes_plugin_contracts_pass_unchanged_with_their_stubs():
    callsite_test = f"{CONTRACTS}/test_plugin_runtime_hook_contracts.py::test_runtime_hook_callsite_is_stable"
    deselect = [arg for case in SOURCE_TEXT_TESTS for arg in ("--deselect", f"{callsite_test}[{case}]")]
    result = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, CONTRACTS, "-q", "-p", "no:cacheprovider", *deselect],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "SLIME_PLUGIN_CONTRACTS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = re.search(r"(\d+) passed, (\d+) deselected", result.stdout)
    assert summary and (int(summary[1]), int(summary[2])) == (31, len(SOURCE_TEXT_TESTS)), result.stdout[-2000:]
    assert "stub modules: [True, True, True]" in result.stdout  # the stubs, not the real packages, were imported
