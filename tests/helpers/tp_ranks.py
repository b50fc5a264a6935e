"""Real ranks of a sharded engine for the tests: `spawn_ranks` starts `world_size` processes (torch multiprocessing
"spawn") joined in one gloo (on GPUs: NCCL) group over tcp:// on a free local port, and runs `worker(rank,
world_size, *args)` in each; `build_runner` makes a ModelRunner of a checkpoint (fp32, a small paged cache) as
rank `parallel.tp_rank`, and `run_steps` drives it through one prefill and several decode steps of a fixed batch,
every rank fed rank 0's sampled tokens, recording what the tests compare (logits, tokens, log-probs, routing)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.engine.config import Config
from slime.engine.model_runner import ModelRunner
from slime.engine.models import load_model_config
from slime.engine.parallel.state import SINGLE, ParallelState
from slime.engine.sampling_params import SamplingParams
from slime.engine.scheduled_batch import ScheduledSequence
from slime.engine.sequence import Sequence

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16
# Mixed batch: a greedy row, a sampled row, a sampled row at another temperature (seeds fixed per row).
PROMPTS = [[10, 20, 30, 40, 50, 60, 70], [9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 33, 5, 41], [3, 1, 4, 1, 5]]
TEMPERATURES = [0.0, 1.0, 0.7]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, worker, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    if backend == "nccl":
        torch.cuda.set_device(rank)  # rank r on cuda:r; device="cuda" then means this rank's GPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, world_size: int, *args, backend: str = "gloo") -> None:
    """Run `worker(rank, world_size, *args)` in `world_size` ranks; raises if any rank fails."""
    mp.start_processes(_rank_main, args=(world_size, free_port(), backend, worker, args), nprocs=world_size,
                       join=True, start_method="spawn")


def rank_parallel(rank: int, world_size: int, ep_size: int = 1) -> ParallelState:
    return ParallelState(rank, world_size, ep_size, dist.group.WORLD)


def build_runner(path, parallel: ParallelState = SINGLE, **config) -> ModelRunner:
    model_config = load_model_config(str(path))
    config = Config(model=str(path), **{"device": "cpu", **config}, kvcache_block_size=BLOCK_SIZE,
                    max_num_seqs=len(PROMPTS), num_kvcache_blocks=BLOCKS_PER_SEQ * len(PROMPTS))
    return ModelRunner(config, model_config, set(model_config.eos_token_ids), parallel)


def run_steps(runner: ModelRunner, num_decode_steps: int, parallel: ParallelState = SINGLE) -> dict:
    """One prefill of PROMPTS then `num_decode_steps` decode steps. Returns per step: `logits` (every computed
    token's, forward_logits), `tokens` / `log_probs` (launch + collect on this rank), `fed` (the tokens appended:
    rank 0's); and `routed_experts` of every sequence at the end (MoE with routing recorded)."""
    seqs = [Sequence(f"s{i}", prompt, SamplingParams(temperature=temperature), seed=100 + i)
            for i, (prompt, temperature) in enumerate(zip(PROMPTS, TEMPERATURES))]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
    batch = [ScheduledSequence(seq, 0, len(seq), True) for seq in seqs]
    record = {"logits": [], "tokens": [], "log_probs": [], "fed": []}
    for _ in range(1 + num_decode_steps):
        record["logits"].append(runner.forward_logits(batch).cpu())
        tokens, log_probs = runner.collect(runner.launch(batch))
        fed = torch.tensor(tokens, dtype=torch.int64, device=runner.device)  # NCCL broadcasts device tensors
        if parallel.tp_size > 1:
            dist.broadcast(fed, src=0, group=parallel.group)
        fed = fed.cpu()
        record["tokens"].append(tokens)
        record["log_probs"].append(log_probs)
        record["fed"].append(fed.tolist())
        for seq, token, log_prob in zip(seqs, fed.tolist(), log_probs):
            seq.num_computed_tokens = len(seq)
            seq.append_token(token, log_prob)
        batch = [ScheduledSequence(seq, len(seq) - 1, 1, True) for seq in seqs]
    if runner.routed_experts is not None:
        record["routed_experts"] = [runner.read_routed_experts(seq.block_table, len(seq) - 1) for seq in seqs]
    return record


def assert_ranks_equal_one_rank(ranks: list[dict], reference: dict) -> None:
    """Every rank's `run_steps` record against the one-rank runner's: logits (fp32, < 3e-5: sums in another order,
    measured up to 1.3e-5 at |logits| ~ 10; the same cases in float64 agree to the last fp32 bit; a wrong shard is off
    by O(1)), equal on every rank; the same tokens, sampled by every rank; log-probs < 1e-5; the same routed experts."""
    assert min(float(step.std()) for step in reference["logits"]) > 1.5  # logits spread: a wrong sum would show
    for rank, got in enumerate(ranks):
        for step, (logits, expected) in enumerate(zip(got["logits"], reference["logits"])):
            assert logits.shape == expected.shape  # the real vocabulary, padding sliced away
            assert (logits - expected).abs().max().item() < 3e-5, (rank, step)
            assert torch.equal(logits, ranks[0]["logits"][step])  # every rank holds the same full logits
        assert got["tokens"] == reference["tokens"], rank  # every rank samples what one rank samples
        assert got["fed"] == reference["tokens"]
        for step, (log_probs, expected) in enumerate(zip(got["log_probs"], reference["log_probs"])):
            assert max(abs(a - b) for a, b in zip(log_probs, expected)) < 1e-5, (rank, step)
        if "routed_experts" in reference:
            for routed, expected in zip(got["routed_experts"], reference["routed_experts"]):
                assert (routed == expected).all(), rank  # global expert ids, as at one rank
    assert len({tokens[1] for tokens in reference["tokens"]}) > 1  # the sampled row really samples


def randomize_biases_and_norms(path, seed: int = 0, std: float = 0.3) -> None:
    """transformers initializes biases to zeros and norm weights to ones, so a bias added N times, or a norm weight
    read at the wrong offset, would not show: give them random values, in place in the checkpoint's files."""
    from safetensors.torch import load_file, save_file

    from slime.engine.models.weight_loader import checkpoint_files

    generator = torch.Generator().manual_seed(seed)
    for file in checkpoint_files(path):
        tensors = load_file(str(file))
        for name, tensor in tensors.items():
            if name.endswith(".bias") or "norm" in name:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * std)
        save_file(tensors, str(file), metadata={"format": "pt"})
