"""slime's synchronous RL loop: generate, reward, train, push weights, repeat.

    python train.py --hf-checkpoint MODEL --prompt-data train.jsonl --rm-type math \
        --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout 10

Each rollout: the RolloutManager generates and scores samples through the engines, the trainer group takes
`num_steps_per_rollout` optimizer steps on them, then pushes the new weights into every engine.
`train_async.py` is the same loop with generation of rollout N+1 overlapping training on rollout N.
"""

from __future__ import annotations

import contextlib
import sys
import time

import ray
from tqdm import tqdm

from slime.config.arguments import parse_args
from slime.config.validate_megatron import require_train_backend
from slime.ray.actor_group import RayTrainGroup, train_with_critic
from slime.ray.placement_group import create_placement_groups, init_ray
from slime.ray.rollout import RolloutManager
from slime.ray.run_failures import RUN_FAILURES, failure_message
from slime.utils.checkpoint_state import load_run_state, should_save
from slime.utils.metrics import MetricsLogger, write_args
from slime.utils.misc import timed


def create_rollout_manager(args, placements):
    # The router address stays the manager's (its own args, where rollout plugins read it; get_router_address
    # gives it to whoever asks): the trainer talks to the engines, never to the router.
    return ray.remote(RolloutManager).options(num_cpus=1).remote(args, placements["rollout"])


@contextlib.contextmanager
def rollout_dump_kept_on_failure(rollout_manager):
    """A run that fails (a NaN, a crash in the loss) still leaves the dump of the rollout it failed on: the manager
    writes --save-debug-rollout-data in the background, and the process ends with the run."""
    try:
        yield
    except BaseException:
        try:
            ray.get(rollout_manager.flush_debug_dump.remote())
        except Exception as flush_error:  # noqa: BLE001 - the run's own failure is the one to raise
            print(f"train.py: {flush_error}", file=sys.stderr)
        raise


def create_training_models(args, placements, rollout_manager):
    actor = RayTrainGroup(args, placements["actor"], role="actor")
    critic = RayTrainGroup(args, placements["actor"], role="critic") if args.use_critic else None
    start_rollout_id = actor.init(with_ref=args.use_kl_loss or args.kl_coef != 0)
    ray.get(rollout_manager.set_trainer.remote(actor))  # gives an engine restarted mid-rollout its weights
    if critic is not None:
        critic.init(with_ref=False)
        if args.offload_train:  # back on the device for its values and update only (train_with_critic)
            critic.offload()
    run_state = load_run_state(args)
    if run_state is not None:
        ray.get(rollout_manager.load_data_source_state.remote(run_state["data_source"]))
    return actor, critic, start_rollout_id


def rollout_and_hand_over(args, actor, rollout_manager, rollout_id) -> tuple[list, dict]:
    """The rollout, then (colocated) the hand-over of the devices to the trainer while the manager turns the samples
    into train data: the engines release their memory (first in the manager's queue) and the trainer takes its own
    back, beside the release when it fits beside the engines' memory. The engines drop their weights rather than
    save them: update_weights pushes every weight before they generate again (with LoRA, which pushes only the
    adapter, they keep them). Returns (train data refs, metrics)."""
    ray.get(rollout_manager.rollout.remote(rollout_id))
    if args.debug_rollout_only:
        return ray.get(rollout_manager.train_data.remote(rollout_id))
    start = time.perf_counter()
    metrics = {}
    # LoRA pushes the adapter alone (or nothing): the engines keep their frozen base weights (a host copy)
    discard = args.lora_rank == 0
    release = rollout_manager.offload.remote(discard_weights=discard) if args.offload_rollout else None
    train_data = rollout_manager.train_data.remote(rollout_id)
    if args.offload_train:
        with timed(metrics, "perf/train_onload_time"):
            if release is None:
                actor.onload()
            else:
                metrics["perf/train_onload_beside_release"] = float(actor.onload_beside(release))
    if release is not None:
        metrics["perf/engine_release_time"] = ray.get(release)
    metrics["perf/hand_over_to_train_time"] = time.perf_counter() - start
    data_refs, rollout_metrics = ray.get(train_data)
    # what the trainer waited for the train data beyond the hand-over (the manager's postprocess runs beside it)
    metrics["perf/train_data_wait_time"] = time.perf_counter() - start - metrics["perf/hand_over_to_train_time"]
    return data_refs, {**rollout_metrics, **metrics}


def update_weights(args, actor, rollout_manager, rollout_id) -> dict:
    # Asked each time: an engine restarted under --use-fault-tolerance has a new URL, and gets this push too.
    engine_urls = ray.get(rollout_manager.get_engine_urls.remote())
    if not engine_urls:
        return {}
    start = time.perf_counter()
    parts = {}
    if args.offload_rollout:
        with timed(parts, "perf/engine_resume_weights_time"):
            ray.get(rollout_manager.onload.remote(["weights"]))
    push = actor.update_weights(engine_urls, weight_version=str(rollout_id + 1))
    ray.get(rollout_manager.weights_pushed.remote(str(rollout_id + 1), engine_urls))
    with timed(parts, "perf/train_offload_time"):
        if args.release_train:  # slime's: the train processes end until the next train step (recreate)
            actor.release()
        elif args.offload_train:
            actor.offload()
    if args.offload_rollout:
        with timed(parts, "perf/engine_resume_kv_time"):
            ray.get(rollout_manager.onload.remote(["kv_cache", "cuda_graph"]))
    # update_weights_time spans the push and the memory hand-over around it; weight_push_* is the push alone.
    return {**parts, "perf/update_weights_time": time.perf_counter() - start, **push.log_metrics()}


def train_on_rollout(args, actor, critic, rollout_id, data_refs) -> dict:
    metrics = {}
    if args.release_train:
        start = time.perf_counter()
        actor.recreate(rollout_id)
        metrics["perf/train_recreate_time"] = time.perf_counter() - start
    start = time.perf_counter()
    if critic is not None:
        metrics.update(train_with_critic(args, actor, critic, rollout_id, data_refs))
    else:
        metrics.update(actor.train(rollout_id, data_refs))
    return {**metrics, "perf/train_time": time.perf_counter() - start}


def save(actor, critic, rollout_manager, rollout_id) -> None:
    run_state = {"data_source": ray.get(rollout_manager.data_source_state.remote(rollout_id + 1))}
    actor.save_model(rollout_id, run_state)
    if critic is not None:
        critic.save_model(rollout_id)


def periodic_eval(args, rollout_manager, rollout_id) -> dict:
    """Eval after training on `rollout_id`, every --eval-interval rollouts."""
    if args.eval_interval and (rollout_id + 1) % args.eval_interval == 0:
        return ray.get(rollout_manager.eval.remote(rollout_id + 1))
    return {}


def train(args) -> str:
    init_ray(args)
    placements = create_placement_groups(args)
    write_args(args)
    logger = MetricsLogger(args)
    rollout_manager = create_rollout_manager(args, placements)
    num_rollout = ray.get(rollout_manager.num_rollout.remote())
    if args.debug_rollout_only:  # as slime: the engines alone, on the checkpoint's weights; no trainer starts
        actor, critic, start_rollout_id = None, None, args.start_rollout_id or 0
    else:
        actor, critic, start_rollout_id = create_training_models(args, placements, rollout_manager)
        update_weights(args, actor, rollout_manager, start_rollout_id - 1)

    if num_rollout == 0 and args.eval_datasets:
        logger.log(start_rollout_id, ray.get(rollout_manager.eval.remote(start_rollout_id)))
    progress = tqdm(range(start_rollout_id, num_rollout), desc="rollouts", disable=args.no_progress,
                    initial=start_rollout_id, total=num_rollout)
    with rollout_dump_kept_on_failure(rollout_manager):
        for rollout_id in progress:
            step_start = time.perf_counter()
            metrics = {}
            if args.eval_datasets and rollout_id == 0 and not args.skip_eval_before_train:
                metrics.update(ray.get(rollout_manager.eval.remote(rollout_id)))

            data_refs, rollout_metrics = rollout_and_hand_over(args, actor, rollout_manager, rollout_id)
            metrics.update(rollout_metrics)
            if args.debug_rollout_only:
                logger.log(rollout_id, metrics, print_fn=progress.write)
                continue
            metrics.update(train_on_rollout(args, actor, critic, rollout_id, data_refs))
            if should_save(args, rollout_id, num_rollout):
                save(actor, critic, rollout_manager, rollout_id)
            metrics.update(update_weights(args, actor, rollout_manager, rollout_id))
            metrics.update(periodic_eval(args, rollout_manager, rollout_id))
            metrics["perf/step_time"] = time.perf_counter() - step_start
            logger.log(rollout_id, metrics, print_fn=progress.write)

    logger.close()
    ray.get(rollout_manager.dispose.remote())
    return args.output_dir


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        require_train_backend(args)
        if args.fully_async:
            raise ValueError("--fully-async is a mode of train_async.py (the engines generate while the trainer "
                             "trains); run train_async.py")
    except ValueError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        output_dir = train(args)
    except RUN_FAILURES as exc:
        print(f"train.py: error: {failure_message(exc)}", file=sys.stderr)
        sys.exit(1)
    print(f"run folder: {output_dir}")


if __name__ == "__main__":
    main()
