"""slime's asynchronous RL loop: generation of rollout N+1 overlaps training on rollout N.

Same flags as train.py (not with --colocate: the engines need their own devices). The data trained on is at most
`--update-weights-interval` policy versions old; before each weight push the loop waits for the in-flight
generation to finish, so no request is served by a mix of weights.

With `--fully-async` the engines never wait for the trainer: they generate continuously from the prompt stream, the
trainer takes each batch as soon as the stream has one, and a weight push pauses the in-flight requests, which go on
under the new weights (docs/guides/fully-async.md). `--max-weight-staleness N` bounds how many versions old a trained
token may be.
"""

from __future__ import annotations

import sys
import time

import ray
from tqdm import tqdm

from slime.config.arguments import parse_args
from slime.config.validate_megatron import require_train_backend
from slime.ray.placement_group import create_placement_groups, init_ray
from slime.ray.run_failures import RUN_FAILURES, failure_message
from slime.utils.checkpoint_state import load_run_state, should_save
from slime.utils.metrics import MetricsLogger, write_args
from train import (
    create_rollout_manager,
    create_training_models,
    periodic_eval,
    rollout_dump_kept_on_failure,
    save,
    train_on_rollout,
    update_weights,
)


def _start_run(args):
    """What both loops do first: Ray, placements, the rollout manager, the models (resumed where --load says) and
    the engines given the starting weights."""
    init_ray(args)
    placements = create_placement_groups(args)
    write_args(args)
    logger = MetricsLogger(args)
    rollout_manager = create_rollout_manager(args, placements)
    num_rollout = ray.get(rollout_manager.num_rollout.remote())
    actor, critic, start_rollout_id = create_training_models(args, placements, rollout_manager)
    update_weights(args, actor, rollout_manager, start_rollout_id - 1)
    return logger, rollout_manager, num_rollout, actor, critic, start_rollout_id


def train_async(args) -> str:
    logger, rollout_manager, num_rollout, actor, critic, start_rollout_id = _start_run(args)

    pre_train_eval = {}
    if args.eval_datasets and start_rollout_id == 0 and not args.skip_eval_before_train:
        pre_train_eval = ray.get(rollout_manager.eval.remote(0))
    in_flight = rollout_manager.generate.remote(start_rollout_id) if start_rollout_id < num_rollout else None
    progress = tqdm(range(start_rollout_id, num_rollout), desc="rollouts", disable=args.no_progress,
                    initial=start_rollout_id, total=num_rollout)
    with rollout_dump_kept_on_failure(rollout_manager):
        for rollout_id in progress:
            step_start = time.perf_counter()
            wait_start = time.perf_counter()
            data_refs, metrics = ray.get(in_flight)
            metrics.update(pre_train_eval if rollout_id == 0 else {})
            metrics["perf/wait_rollout_time"] = time.perf_counter() - wait_start
            in_flight = rollout_manager.generate.remote(rollout_id + 1) if rollout_id + 1 < num_rollout else None

            metrics.update(train_on_rollout(args, actor, critic, rollout_id, data_refs))
            if should_save(args, rollout_id, num_rollout):
                save(actor, critic, rollout_manager, rollout_id)
            if args.release_train or (rollout_id + 1) % args.update_weights_interval == 0:
                if in_flight is not None:
                    ray.wait([in_flight])  # never swap weights under a running generation
                metrics.update(update_weights(args, actor, rollout_manager, rollout_id))
            metrics.update(periodic_eval(args, rollout_manager, rollout_id))
            metrics["perf/step_time"] = time.perf_counter() - step_start
            logger.log(rollout_id, metrics, print_fn=progress.write)

    logger.close()
    ray.get(rollout_manager.dispose.remote())
    return args.output_dir


def save_fully_async(actor, critic, rollout_manager, rollout_id) -> None:
    """The checkpoint of a fully async run: model, optimizer and the stream (version, buffer, in-flight prompts)."""
    actor.save_model(rollout_id, ray.get(rollout_manager.stream_state.remote()))
    if critic is not None:
        critic.save_model(rollout_id)


def push_while_generating(args, actor, rollout_manager, rollout_id) -> dict:
    """Pause the engines between two steps (in-flight requests come back with their tokens so far), push the
    weights of version `rollout_id + 1`, let the stream go on under them."""
    start = time.perf_counter()
    ray.get(rollout_manager.pause_generation.remote())
    metrics = update_weights(args, actor, rollout_manager, rollout_id)
    ray.get(rollout_manager.continue_generation.remote(rollout_id + 1))
    return {**metrics, "perf/generation_paused_time": time.perf_counter() - start}


def train_fully_async(args) -> str:
    logger, rollout_manager, num_rollout, actor, critic, start_rollout_id = _start_run(args)
    run_state = load_run_state(args) or {}
    ray.get(rollout_manager.start_stream.remote(start_rollout_id, run_state.get("stream")))

    pre_train_eval = {}
    if args.eval_datasets and start_rollout_id == 0 and not args.skip_eval_before_train:
        pre_train_eval = ray.get(rollout_manager.eval.remote(0))
    progress = tqdm(range(start_rollout_id, num_rollout), desc="rollouts", disable=args.no_progress,
                    initial=start_rollout_id, total=num_rollout)
    with rollout_dump_kept_on_failure(rollout_manager):
        for rollout_id in progress:
            step_start = time.perf_counter()
            data_refs, metrics = ray.get(rollout_manager.stream_batch.remote(rollout_id))
            wait_time = time.perf_counter() - step_start
            metrics.update(pre_train_eval if rollout_id == start_rollout_id else {})
            metrics["perf/wait_rollout_time"] = wait_time

            metrics.update(train_on_rollout(args, actor, critic, rollout_id, data_refs))
            if should_save(args, rollout_id, num_rollout):
                save_fully_async(actor, critic, rollout_manager, rollout_id)
            if (rollout_id + 1) % args.update_weights_interval == 0:
                metrics.update(push_while_generating(args, actor, rollout_manager, rollout_id))
            metrics.update(periodic_eval(args, rollout_manager, rollout_id))  # the stream goes on meanwhile
            metrics["perf/step_time"] = time.perf_counter() - step_start
            metrics["perf/trainer_idle_fraction"] = wait_time / metrics["perf/step_time"]
            logger.log(rollout_id, metrics, print_fn=progress.write)

    num_unused = ray.get(rollout_manager.stop_stream.remote())
    print(f"fully async: {num_unused} generated or generating group(s) were not trained (the run ended)")
    logger.close()
    ray.get(rollout_manager.dispose.remote())
    return args.output_dir


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        require_train_backend(args)
        if args.colocate:
            raise ValueError("--colocate is not supported by train_async.py; use train.py")
    except ValueError as exc:
        print(f"train_async.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        output_dir = train_fully_async(args) if args.fully_async else train_async(args)
    except RUN_FAILURES as exc:
        print(f"train_async.py: error: {failure_message(exc)}", file=sys.stderr)
        sys.exit(1)
    print(f"run folder: {output_dir}")


if __name__ == "__main__":
    main()
