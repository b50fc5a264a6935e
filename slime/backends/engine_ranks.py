"""Which engine rank a weight push reaches, and how: the arithmetic of engines that span several devices.

An engine of N ranks (`--rollout-num-gpus-per-engine N`, SGLang's `--tp-size`) takes every weight push on all of
them; this module is the bookkeeping, pure and torch-free:
- colocated tensor push: trainer rank r feeds engine r // N as its TP rank r % N, the N trainer ranks of an engine
  gathering their N serialized entries to the first of them, which POSTs the list (`colocated_engine`,
  `group_ranks`); engines past the trainer's ranks get all N entries from trainer rank 0;
- weight broadcast group: the trainer is rank 0 of a group of 1 + the ranks of every engine, engine i's ranks at
  offset 1 + the ranks of the engines before it (`broadcast_layout`);
- after every push each engine answers with a report per rank, `"ranks": [{"rank", "weight_version",
  "checksum"}]`; `check_rank_reports` turns a missing rank or a rank at another version into an error naming the
  engine's URL and the rank.
Not the transport (slime/backends/weight_sender.py) and not the engine's side (slime/engine/server/weights.py).
"""

from __future__ import annotations


class EngineRankError(RuntimeError):
    """An engine rank that did not take a weight push (or did not say it did)."""


def as_engine_map(engine_urls) -> dict[int, str]:
    """{engine index: URL}: a dict as given (sorted by index), a list as engines 0, 1, ... in order."""
    if isinstance(engine_urls, dict):
        return {int(index): url for index, url in sorted(engine_urls.items())}
    return dict(enumerate(engine_urls))


def num_colocated_engines(world_size: int, per_engine: int) -> int:
    """Engines whose N devices are all trainer devices: those trainer rank groups feed themselves."""
    return world_size // per_engine


def colocated_engine(rank: int, per_engine: int, world_size: int) -> int | None:
    """The engine trainer rank `rank` feeds (r // N), or None when its group of N ranks is incomplete."""
    engine = rank // per_engine
    return engine if engine < num_colocated_engines(world_size, per_engine) else None


def group_ranks(engine: int, per_engine: int) -> list[int]:
    """The trainer ranks that feed colocated engine `engine`, in TP rank order (the first one POSTs)."""
    return list(range(engine * per_engine, (engine + 1) * per_engine))


def broadcast_layout(engine_ranks: dict[int, int]) -> tuple[int, dict[int, int]]:
    """(world size, {engine index: rank offset}) of the weight broadcast group: the trainer is rank 0, then the
    engines in index order, each with as many ranks as it has."""
    offsets, next_rank = {}, 1
    for engine, num_ranks in sorted(engine_ranks.items()):
        if num_ranks < 1:
            raise ValueError(f"engine {engine} has {num_ranks} ranks; an engine has at least one")
        offsets[engine] = next_rank
        next_rank += num_ranks
    return next_rank, offsets


def check_rank_reports(url: str, response: dict, num_ranks: int, weight_version: str | None,
                       required: bool) -> None:
    """EngineRankError naming `url` and the rank when the response's "ranks" does not report each of the engine's
    `num_ranks` ranks once (at `weight_version`, when the push set one). A response without "ranks" (SGLang's) is
    an error only when `required` (the built-in engine always reports them)."""
    reports = response.get("ranks")
    if reports is None:
        if required:
            raise EngineRankError(f"engine {url} answered a weight update without its per-rank reports (\"ranks\"): "
                                  "it cannot show that each of its ranks took the push")
        return
    if not isinstance(reports, list) or not all(isinstance(r, dict) and isinstance(r.get("rank"), int)
                                                 for r in reports):
        raise EngineRankError(f"engine {url}: \"ranks\" must be a list of {{rank, weight_version, checksum}}, "
                              f"got {str(reports)[:200]}")
    by_rank: dict[int, dict] = {}
    for report in reports:
        if report["rank"] in by_rank:
            raise EngineRankError(f"engine {url}: rank {report['rank']} reported twice for one weight update")
        by_rank[report["rank"]] = report
    extra = sorted(set(by_rank) - set(range(num_ranks)))
    if extra:
        raise EngineRankError(f"engine {url} reported rank(s) {extra}, but it has {num_ranks} rank(s) "
                              "(--rollout-num-gpus-per-engine)")
    for rank in range(num_ranks):
        if rank not in by_rank:
            raise EngineRankError(f"engine {url}: rank {rank} did not report the weight update (a rank that missed "
                                  "the push would serve stale weights)")
        held = by_rank[rank].get("weight_version")
        if weight_version is not None and held != weight_version:
            raise EngineRankError(f"engine {url}: rank {rank} holds weight version {held!r} after the push of "
                                  f"version {weight_version!r}")
