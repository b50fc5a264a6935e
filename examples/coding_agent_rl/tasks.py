"""Small repository tasks for the coding-agent example, built locally: a Python package with one bug, its visible
tests, and hidden tests that grade the agent's diff (swe.py's row schema).

    python -m examples.coding_agent_rl.tasks OUT.jsonl [--num-rows 64] [--seed 0]

Each row: `prompt` (the problem statement), `label` (the instance id), `metadata` = {instance_id, image: "host",
workdir, problem_statement, files, hidden_tests, eval_cmd}. The package `mathlib` has one function whose operator is
wrong (e.g. `subtract` adds); `tests/test_mathlib.py` (visible, may be run by the agent) and
`tests/hidden_test_mathlib.py` (written over the workspace only when grading) are plain Python (no pytest needed in
the sandbox) and print `TESTS_PASSED k/n`. Not a benchmark: a task a CPU-sized policy can act on.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
from pathlib import Path

WORKDIR = "/workspace/repo"
# name, right operator, wrong operator, (a, b) cases
FUNCTIONS = [
    ("add", "+", "-", [(2, 3), (10, -4), (0, 7)]),
    ("subtract", "-", "+", [(9, 4), (3, 8), (-2, -2)]),
    ("multiply", "*", "+", [(3, 4), (5, 0), (-2, 6)]),
    ("floor_divide", "//", "%", [(9, 2), (20, 5), (7, 7)]),
    ("power", "**", "*", [(2, 5), (3, 3), (10, 0)]),
]

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "**": operator.pow}
TEST_RUNNER = '''

def run(cases):
    passed = 0
    for fn, args, expected in cases:
        try:
            ok = fn(*args) == expected
        except Exception:
            ok = False
        passed += ok
        print(("ok  " if ok else "FAIL"), fn.__name__, args)
    print(f"TESTS_PASSED {passed}/{len(cases)}")
    sys.exit(0 if passed == len(cases) else 1)
'''


def _module(buggy: str) -> str:
    lines = ['"""Integer arithmetic helpers."""', ""]
    for name, right, wrong, _ in FUNCTIONS:
        operator = wrong if name == buggy else right
        lines += [f"def {name}(a, b):", f"    return a {operator} b", "", ""]
    return "\n".join(lines).rstrip() + "\n"


def _test_file(names: list[str], case_slice: slice) -> str:
    cases = []
    for name, right, _, pairs in FUNCTIONS:
        if name in names:
            for a, b in pairs[case_slice]:
                cases.append(f"    ({name}, ({a}, {b}), {OPERATORS[right](a, b)}),")
    return ("import sys\n\nsys.path.insert(0, '.')\nfrom mathlib.ops import " + ", ".join(names) + "\n" + TEST_RUNNER
            + "\n\nif __name__ == '__main__':\n    run([\n" + "\n".join(cases) + "\n    ])\n")


def build_row(index: int, rng: random.Random) -> dict:
    buggy = FUNCTIONS[rng.randrange(len(FUNCTIONS))][0]
    names = [name for name, *_ in FUNCTIONS]
    instance_id = f"mathlib-{buggy}-{index}"
    statement = (f"`mathlib.ops.{buggy}` returns wrong results. Fix it in mathlib/ops.py so that "
                 f"`python3 tests/test_mathlib.py` passes.")
    return {
        "prompt": statement,
        "label": instance_id,
        "metadata": {
            "instance_id": instance_id, "image": "host", "workdir": WORKDIR, "problem_statement": statement,
            "files": {"mathlib/__init__.py": "", "mathlib/ops.py": _module(buggy),
                      "tests/test_mathlib.py": _test_file(names, slice(0, 2)),
                      "README.md": "# mathlib\n\nRun the tests with `python3 tests/test_mathlib.py`.\n"},
            "hidden_tests": {"tests/hidden_test_mathlib.py": _test_file(names, slice(0, 3))},
            "eval_cmd": "python3 tests/hidden_test_mathlib.py",
        },
    }


def build_tasks(path: str | Path, num_rows: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(build_row(i, rng)) + "\n" for i in range(num_rows)))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--num-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    print(build_tasks(opts.out, opts.num_rows, opts.seed))
