"""Args for tests, as the code gets them from train.py: `make_args(*flags, **overrides)` is `parse_args` of a
minimal valid command line plus `flags`, with `overrides` set on the result. Every flag and every field validation
derives is there, at its default unless a test says otherwise; a field set through `overrides` skips validation
(and what validation would derive from it), a flag passed in `flags` does not."""

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from slime.config.arguments import parse_args


@functools.cache
def stand_in_model() -> str:
    """A folder with an empty config.json: --hf-checkpoint must name a Hugging Face folder, and nothing these
    tests run reads the model (a test that tokenizes overrides hf_checkpoint with a real one)."""
    folder = Path(tempfile.mkdtemp(prefix="slime_test_args_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "config.json").write_text("{}")
    return str(folder)


def make_args(*flags, **overrides):
    args = parse_args(["--hf-checkpoint", stand_in_model(), "--rollout-batch-size", "1", "--num-rollout", "1",
                       "--rm-type", "math", *map(str, flags)])
    vars(args).update(overrides)
    return args
