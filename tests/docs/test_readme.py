"""The README's first screen: the two commands that work on a fresh machine, then at most 150 words before the first
section, and a link to the docs site that resolves."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    assert blocks[:2] == ["bash scripts/setup.sh && .venv/bin/python examples/quickstart/run.py",
                          "bash scripts/setup.sh && .venv/bin/python -m pytest -q tests"]
    assert README.index("```bash") < README.index("\n## ")
    assert (REPO / "examples/quickstart/run.py").is_file() and (REPO / "scripts/setup.sh").is_file()


def test_the_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci/run").read_text()
    assert "bash scripts/setup.sh" in ci and ".venv/bin/python -m pytest -q tests" in ci


def test_at_most_150_words_before_the_first_section_and_the_docs_linked():
    first_screen = README[: README.index("\n## ")]
    words = re.sub(r"```.*?```", "", first_screen, flags=re.S).split()
    assert len(words) <= 150, len(words)
    links = re.findall(r"\]\((docs/[^)]+)\)", first_screen)
    assert links and all((REPO / link).is_file() for link in links)
