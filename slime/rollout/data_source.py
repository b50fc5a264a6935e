"""Data sources: hand prompt groups to the rollout function, epoch after epoch, resumably.

`RolloutDataSource` walks the prompt dataset with a cursor; each prompt becomes a group of
`--n-samples-per-prompt` deep copies carrying `group_index` and a global `index`. Crossing the end of the dataset
starts a new epoch, reshuffled with `--rollout-seed + epoch_id` when `--rollout-shuffle` is on, so the order is a
pure function of (seed, epoch, cursor) and a resumed run continues with exactly the same prompts.

`RolloutDataSourceWithBuffer` (the default) adds a buffer in front: groups returned by `add_samples` (partially
generated groups under `--partial-rollout`) are handed out again before new prompts.

`create_data_source(args)` builds the class named by `--data-source-path`. Dataset parsing lives in dataset.py.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from abc import ABC, abstractmethod
from pathlib import Path

from slime.rollout.dataset import PromptFormat, load_prompt_samples, tokenizer_for
from slime.rollout.multimodal_data import sample_dict_from_json, sample_dict_to_json
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


class DataSource(ABC):
    @abstractmethod
    def get_samples(self, num_groups: int) -> list[list[Sample]]: ...

    @abstractmethod
    def add_samples(self, groups: list[list[Sample]]) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def state_path(self, target: int | str | os.PathLike) -> Path:
        """A rollout id maps to `{--save}/rollout/data_source_state_{rollout_id}.json`; a path is used as is."""
        if isinstance(target, int):
            save_dir = self.args.save
            if not save_dir:
                raise ValueError("saving the data-source state by rollout id needs --save (the checkpoint directory)")
            return Path(save_dir) / "rollout" / f"data_source_state_{target}.json"
        return Path(target)

    def save(self, target: int | str | os.PathLike) -> Path:
        """Write state_dict() as JSON (atomically: a crash mid-write leaves the previous file intact)."""
        path = self.state_path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        os.replace(tmp, path)
        return path

    def load(self, target: int | str | os.PathLike) -> bool:
        """Restore the state saved by `save(target)`. Returns False (and keeps the fresh state) if there is none."""
        path = self.state_path(target)
        if not path.exists():
            logger.info("no data-source state at %s; starting from the beginning of the dataset", path)
            return False
        self.load_state_dict(json.loads(path.read_text()))
        return True


class RolloutDataSource(DataSource):
    """Sequential, epoch-based source over `--prompt-data` (or empty Samples when there is no global dataset)."""

    def __init__(self, args):
        self.args = args
        self.n_samples_per_prompt = args.n_samples_per_prompt
        # slime's plugins may pass args without these flags
        self.shuffle = getattr(args, "rollout_shuffle", False)
        self.seed = getattr(args, "rollout_seed", 42)
        self.epoch_id = 0
        self.sample_offset = 0  # cursor into the current epoch's order
        self.sample_group_index = 0
        self.sample_index = 0
        self.metadata: dict = {}
        self.prompts: list[Sample] | None = None
        self.num_filtered_long_prompts = 0
        prompt_data = getattr(args, "prompt_data", None)  # slime's plugins may pass args without this flag
        if prompt_data and args.rollout_global_dataset:
            self.prompts, self.num_filtered_long_prompts = load_prompt_samples(
                prompt_data, PromptFormat.from_args(args), tokenizer_for(args)
            )
        self._order = self._epoch_order(self.epoch_id)

    def __len__(self) -> int:
        return len(self.prompts) if self.prompts is not None else 0

    def _epoch_order(self, epoch_id: int) -> list[int]:
        order = list(range(len(self)))
        if self.shuffle:
            random.Random(self.seed + epoch_id).shuffle(order)
        return order

    def _next_prompt(self) -> Sample:
        if self.prompts is None:
            return Sample()
        if self.sample_offset >= len(self.prompts):
            self.epoch_id += 1
            self.sample_offset = 0
            self._order = self._epoch_order(self.epoch_id)
        prompt = self.prompts[self._order[self.sample_offset]]
        self.sample_offset += 1
        return prompt

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_groups):
            prompt = self._next_prompt()
            group = []
            for _ in range(self.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise RuntimeError(f"{type(self).__name__} has no buffer; use RolloutDataSourceWithBuffer (--data-source-path)")

    def state_dict(self) -> dict:
        return {
            "epoch_id": self.epoch_id,
            "sample_offset": self.sample_offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "metadata": copy.deepcopy(self.metadata),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch_id = int(state["epoch_id"])
        self.sample_offset = int(state["sample_offset"])
        self.sample_group_index = int(state["sample_group_index"])
        self.sample_index = int(state["sample_index"])
        self.metadata = copy.deepcopy(state.get("metadata", {}))
        self._order = self._epoch_order(self.epoch_id)


def pop_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """Default `--buffer-filter-path` (slime's signature; `num_samples` counts groups): the oldest groups first."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The default source: buffered groups first (oldest first, or `--buffer-filter-path`), then new prompts."""

    def __init__(self, args):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        filter_path = args.buffer_filter_path
        self.buffer_filter = load_function(filter_path, "--buffer-filter-path") if filter_path else pop_first

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self.buffer_filter(self.args, None, self.buffer, num_groups) if self.buffer else []
        if len(groups) > num_groups:
            raise ValueError(f"--buffer-filter-path returned {len(groups)} groups, more than the {num_groups} asked")
        return groups + super().get_samples(num_groups - len(groups))

    def add_samples(self, groups: list[list[Sample]]) -> None:
        for group in groups:
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise ValueError(f"add_samples takes a list of groups (lists of Sample), got {type(group).__name__}")
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(
                    f"a group added to the buffer has {len(group)} samples; --n-samples-per-prompt is "
                    f"{self.n_samples_per_prompt}"
                )
        self.buffer.extend(groups)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["buffer"] = [[sample_dict_to_json(sample.to_dict()) for sample in group] for group in self.buffer]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer = [[Sample.from_dict(sample_dict_from_json(d)) for d in group] for group in state.get("buffer", [])]


def create_data_source(args) -> DataSource:
    """Instantiate the class named by `--data-source-path` (default RolloutDataSourceWithBuffer) with args."""
    return load_function(args.data_source_path, "--data-source-path")(args)
