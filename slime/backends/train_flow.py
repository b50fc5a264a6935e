"""TrainFlow: one training process of the policy, the seed's `train` / `train_actor` written once for every
backend. A plain class; the Ray layer wraps it as an actor per device. It owns the flow: other weight sets as host
copies (reference "ref", OPD teacher "teacher", and with --keep-old-actor the last two pushed versions) switched
into the backend's model for forward-only passes; old / ref / teacher log-probs; advantages and returns; the loss
and its global denominators; `num_steps_per_rollout` optimizer steps; the reference update interval; metrics; the
weight push. The backend (backend.py: FSDP2 in fsdp_utils, Megatron in megatron_utils) owns the model. With ppo,
the advantages come from GAE over the critic's values (`train(..., values)`; the critic: critic_flow.py).

User hooks (dotted paths): --custom-init-path fn(args) at init; --custom-before-log-prob-hook-path
fn(args, model, store_prefix) before each forward-only pass ("ref_" for the reference, "teacher_" for the OPD
teacher, "pushed:<version>_" for --keep-old-actor, "" for old log-probs);
--custom-before-train-step-hook-path fn(args, rollout_id, step_id, model, optimizer, scheduler).

Not here: reward post-processing and the data split over ranks (RolloutManager), the Ray plumbing (slime/ray).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from tqdm import tqdm

from slime.backends.advantages import compute_advantages
from slime.backends.backend import TrainBackend
from slime.backends.debug_train_data import rank_train_data, save_debug_train_data
from slime.backends.device_room import DeviceRoom
from slime.backends.lora_adapter import adapted_layers, peft_config
from slime.backends.lora_metrics import lora_metrics, reset_peak_memory, train_peak_memory_metrics
from slime.backends.lora_push import AdapterPusher
from slime.backends.loss import (
    LossReducer,
    MicroBatchTensors,
    aggregation_mode,
    can_reuse_log_probs_in_loss,
    get_loss_function,
)
from slime.backends.packing import float_tensors, outputs_per_sample, to_device
from slime.backends.rank_metrics import global_masked_mean, mismatch_metrics, router_agreement_metrics
from slime.backends.routing_replay import (
    ReplayStage,
    attach_records,
    attach_rollout_routing,
    log_prob_stage,
)
from slime.backends.schedule import forward_only_schedule, train_schedule
from slime.backends.train_flow_handover import TrainFlowHandover
from slime.backends.weight_sender import weight_sender_from_args
from slime.backends.weight_snapshot import WeightSnapshot, place_weight_sets
from slime.config.flags_lora import serves_adapter
from slime.utils.checkpoint_state import initial_weights, weights_at_step
from slime.utils.engine_access import engine_admin_headers
from slime.utils.misc import load_function, seed_everything, use_deterministic_kernels
from slime.utils.ppo_utils import apply_opd_advantage, loss_denominator
from slime.utils.train_data_types import TrainData

logger = logging.getLogger(__name__)


class TrainFlow(TrainFlowHandover):
    def __init__(self, args, backend: TrainBackend, role: str = "actor", master_addr: str = "127.0.0.1"):
        self.args, self.backend, self.role = args, backend, role
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = backend.device
        self.master_addr = master_addr
        self.with_ref = False
        self.last_step_metrics: list[dict] = []  # per optimizer step of the last train() call
        self.pushed_versions: list[str] = []  # --keep-old-actor: weight versions held in self.snapshot
        self.pass_entropy: dict[str, dict[int, torch.Tensor]] = {}  # --use-rollout-entropy, by log-prob pass
        self.snapshot = WeightSnapshot(backend.local_weights)  # weight sets by tag (none for the critic)
        self.device_room = DeviceRoom(self.device)  # what an onload takes back, and whether it fits now

    @property
    def model(self):
        return self.backend.model

    # ------------------------------------------------------------------------------------------------ setup
    def init(self, with_ref: bool = False) -> int:
        """Build model, optimizer and reference weights; resume from --load. Returns the first rollout id."""
        args = self.args
        seed_everything(args.seed)
        if args.deterministic_mode:
            use_deterministic_kernels()
        self.hooks = {name: load_function(path, "--" + name.replace("_", "-")) if path else None
                      for name, path in (("custom_init_path", args.custom_init_path),
                                         ("custom_before_log_prob_hook_path", args.custom_before_log_prob_hook_path),
                                         ("custom_before_train_step_hook_path",
                                          args.custom_before_train_step_hook_path))}
        if self.hooks["custom_init_path"]:
            self.hooks["custom_init_path"](args)
        backend = self.backend
        resume_dir = backend.resolve_load_dir(args.load)  # a complete checkpoint or None (validated at parse time)
        weights_path = str(resume_dir) if resume_dir is not None else initial_weights(args)
        if not weights_path:
            raise ValueError("no model to train: pass --hf-checkpoint (a Hugging Face folder)")
        backend.build_policy(weights_path)
        if (args.use_routing_replay or args.use_rollout_routing_replay) and backend.routing_replay is None:
            raise ValueError("--use-routing-replay / --use-rollout-routing-replay: this policy has no MoE router "
                             f"the {type(backend).__name__} can replay (a dense model?)")
        # LoRA: the reference is the frozen base with the adapters disabled, no weight set of its own (as verl).
        self.lora = args.lora_rank > 0
        self.with_ref = bool(with_ref) and (bool(args.ref_load) or self.lora)
        if self.lora and args.ref_load and self.rank == 0:
            logger.info("--lora-rank %d: the reference model is the frozen base (--hf-checkpoint) with the adapters "
                        "disabled; --ref-load %s is not loaded", args.lora_rank, args.ref_load)
        # Both sides offload: our copies leave before the engines take the device back; else theirs counts as used.
        engines_release_memory = bool(args.colocate and args.offload_rollout and args.offload_train)
        if not engines_release_memory:
            place_weight_sets(self.snapshot, args, self.device, self.with_ref, engines_release_memory)
        # Reference and OPD teacher: other weight sets of the same architecture, kept as host shards.
        extra_weights = {"ref": args.ref_load if self.with_ref and not self.lora else None,
                         "teacher": args.opd_teacher_load}
        steps = {"ref": (args.ref_ckpt_step, "--ref-ckpt-step"), "teacher": (args.opd_teacher_ckpt_step,
                                                                              "--opd-teacher-ckpt-step")}
        extra_weights = {tag: path and weights_at_step(path, *steps[tag]) for tag, path in extra_weights.items()}
        if any(extra_weights.values()):
            self.snapshot.save("actor")
            for tag, path in extra_weights.items():
                if path:
                    backend.load_hf_weights(path)
                    self.snapshot.save(tag)
            self.snapshot.restore("actor")
        if engines_release_memory:  # placed now: the device copies come with the first onload, not beside engines
            place_weight_sets(self.snapshot, args, self.device, self.with_ref, engines_release_memory)
        if serves_adapter(args):  # LoRA: only the adapter travels, verified (lora_push.py)
            self.weight_updater = AdapterPusher(backend.adapter_weights,
                                                lambda adapter: peft_config(args, adapted_layers(adapter)), self.rank,
                                                headers=engine_admin_headers(args),
                                                disk_dir=args.update_weight_disk_dir,
                                                keep_files=args.update_weight_disk_keep_files,
                                                check_weight_equal=args.check_lora_weight_equal,
                                                adapter_names=args.lora_adapter_names if args.lora_adapter_key
                                                else None,
                                                on_gpu=backend.device.type == "cuda", master_address=self.master_addr)
        else:
            self.weight_updater = weight_sender_from_args(args, backend, self.rank, self.master_addr)
        self.loss_fn = get_loss_function(args)
        if resume_dir is not None:
            return backend.load_training_state(resume_dir) + 1
        return args.start_rollout_id or 0

    # -------------------------------------------------------------------------------------------- schedule
    def _schedule(self, data: TrainData) -> list[list]:
        return train_schedule(self.args, data, self.backend)

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        return self.backend.all_reduce(tensor, op)

    @torch.no_grad()
    def compute_log_probs(self, schedule, store_prefix: str = "") -> dict[int, torch.Tensor]:
        """Log-probs (CPU, fp32) of every sample's response tokens under the current weights; with
        --use-rollout-entropy the pass's entropies go to `self.pass_entropy[store_prefix]`."""
        if self.hooks["custom_before_log_prob_hook_path"]:
            self.hooks["custom_before_log_prob_hook_path"](self.args, self.model, store_prefix)
        replay = self.backend.routing_replay
        if replay is not None:
            replay.stage = log_prob_stage(self.args, store_prefix)
        with_entropy = self.args.use_rollout_entropy

        def forward_all(micro_batches):
            outputs = self.backend.forward_only(micro_batches)
            if with_entropy:  # one [tokens, 2] tensor per micro-batch: split per sample with the log-probs
                return [torch.stack([log_probs, entropy.to(log_probs)], dim=1) for log_probs, entropy in outputs]
            return [log_probs for log_probs, _ in outputs]

        try:
            by_index = outputs_per_sample(schedule, forward_all)
            if with_entropy:
                self.pass_entropy[store_prefix] = {i: pair[:, 1].contiguous() for i, pair in by_index.items()}
                by_index = {i: pair[:, 0].contiguous() for i, pair in by_index.items()}
        finally:
            if replay is not None:
                if replay.stage is ReplayStage.RECORD:
                    attach_records(schedule, replay.take_records())
                replay.stage = ReplayStage.FALLTHROUGH
        return by_index

    # ---------------------------------------------------------------------------------------------- train
    def _log_probs_with(self, tag: str, schedule, num_samples: int) -> list[torch.Tensor]:
        """Log-probs under the saved weight set `tag` ("ref", "teacher"), then back to the actor's weights. LoRA: the
        reference is the base with the adapters off; a teacher is loaded into the base and runs with them off."""
        if self.lora and tag == "ref":
            with self.backend.adapters_disabled():
                by_index = self.compute_log_probs(schedule, store_prefix="ref_")
            return [by_index[i] for i in range(num_samples)]
        self.snapshot.save("actor")
        self.snapshot.restore(tag)
        with self.backend.adapters_disabled() if self.lora and tag == "teacher" else contextlib.nullcontext():
            by_index = self.compute_log_probs(schedule, store_prefix=f"{tag}_")
        self.snapshot.restore("actor")
        return [by_index[i] for i in range(num_samples)]

    def _prepare(self, data: TrainData, values: list[torch.Tensor] | None = None):
        """Old/ref/teacher log-probs, advantages and returns of a rank's data: (schedule, per-sample, metrics)."""
        args = self.args
        num_samples = len(data["tokens"])
        schedule = self._schedule(data)
        log_prob_schedule = forward_only_schedule(self.args, data, self.backend, schedule)
        if args.use_rollout_routing_replay:
            attach_rollout_routing(schedule, data, self.backend.routing_replay)
            if log_prob_schedule is not schedule:
                attach_rollout_routing(log_prob_schedule, data, self.backend.routing_replay)
        self.pass_entropy = {}
        loss_masks = float_tensors(data["loss_masks"])
        rollout_log_probs = (float_tensors(data["rollout_log_probs"])
                             if data.get("rollout_log_probs") else None)
        ref_log_probs = None
        if self.with_ref and (args.use_kl_loss or args.kl_coef != 0):
            ref_log_probs = self._log_probs_with("ref", log_prob_schedule, num_samples)
        if args.use_rollout_logprobs:
            if rollout_log_probs is None:
                raise ValueError("--use-rollout-logprobs but the rollout returned no log-probs")
            old_log_probs = rollout_log_probs
        elif args.keep_old_actor:
            old_log_probs = self._log_probs_of_generating_weights(data, log_prob_schedule, num_samples)
        elif args.loss_type == "policy_loss" and not can_reuse_log_probs_in_loss(args, len(schedule)):
            old = self.compute_log_probs(log_prob_schedule)
            old_log_probs = [old[i] for i in range(num_samples)]
        else:
            old_log_probs = None
        metrics = router_agreement_metrics(self.backend, args, self.device)
        if rollout_log_probs is not None and old_log_probs is not None and not args.use_rollout_logprobs:
            metrics.update(mismatch_metrics(self.backend, args, old_log_probs, rollout_log_probs, loss_masks,
                                            self.device))
        advantages = returns = None
        if args.loss_type != "sft_loss" and args.compute_advantages_and_returns:
            advantages, returns = compute_advantages(args, data["rewards"], loss_masks, old_log_probs, ref_log_probs,
                                                     dict(data), values)
            if args.use_opd:
                teacher = self._teacher_log_probs(data, log_prob_schedule, num_samples)
                advantages = [apply_opd_advantage(a, o, t, args.opd_kl_coef)
                              for a, o, t in zip(advantages, old_log_probs, teacher)]
                reverse_kl = [o - t for o, t in zip(old_log_probs, teacher)]
                metrics["train/opd_reverse_kl"] = global_masked_mean(self.backend, reverse_kl, loss_masks, self.device)
        # sample_mean divides each sample's token sum by its rollout's (siblings of a fan-out share one mean)
        rollout_token_counts = data.get("rollout_mask_sums") or [float(m.sum()) for m in loss_masks]
        rollout_sizes = data.get("rollout_num_samples") or [1] * len(loss_masks)
        per_sample = dict(loss_masks=loss_masks, advantages=advantages, old_log_probs=old_log_probs,
                          total_lengths=[len(tokens) for tokens in data["tokens"]],
                          ref_log_probs=ref_log_probs, rollout_log_probs=rollout_log_probs, returns=returns,
                          rollout_token_counts=[float(c) for c in rollout_token_counts],
                          rollout_shares=[1.0 / n for n in rollout_sizes])
        for prefix, entropies in self.pass_entropy.items():  # --use-rollout-entropy: slime's entropy, ref_entropy
            key = f"{prefix.rstrip('_') or 'old'}_entropy"
            per_sample[key] = [entropies[i] for i in range(num_samples)]
            metrics[f"rollout/{prefix}entropy"] = global_masked_mean(self.backend, per_sample[key], loss_masks,
                                                                     self.device)
        return schedule, per_sample, metrics

    def _log_probs_of_generating_weights(self, data: TrainData, schedule, num_samples: int) -> list[torch.Tensor]:
        """--keep-old-actor: old log-probs under the pushed weights each sample was generated with (its last
        weight version), not the current ones (async training is a rollout behind)."""
        versions = data.get("weight_versions")
        if not versions or any(v is None for v in versions):
            raise ValueError("--keep-old-actor: the rollout data carries no weight versions (the engine must report "
                             "meta_info.weight_version)")
        missing = sorted(set(versions) - set(self.pushed_versions))
        if missing:
            raise ValueError(f"--keep-old-actor: samples were generated with weight versions {missing}, but this "
                             f"trainer only holds {self.pushed_versions} (the last two it pushed)")
        result = [None] * num_samples
        for version in sorted(set(versions)):
            by_version = self._log_probs_with(f"pushed:{version}", schedule, num_samples)
            for i in range(num_samples):
                if versions[i] == version:
                    result[i] = by_version[i]
        return result

    def _teacher_log_probs(self, data: TrainData, schedule, num_samples: int) -> list[torch.Tensor]:
        if self.args.opd_teacher_load:
            return self._log_probs_with("teacher", schedule, num_samples)
        if not data.get("teacher_log_probs"):
            raise ValueError("--use-opd: the train data has no teacher_log_probs; pass --opd-teacher-load or have the "
                             "custom rollout / generate function set Sample.teacher_log_probs")
        return float_tensors(data["teacher_log_probs"])

    def returns_for_critic(self, rollout_id: int, data: TrainData, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """PPO during --num-critic-only-steps: the critic's targets (GAE with the reward KL), no policy update."""
        return self._prepare(data, values)[1]["returns"]

    def train(self, rollout_id: int, data: TrainData, values: list[torch.Tensor] | None = None) -> dict:
        """`num_steps_per_rollout` optimizer steps on a rank's data (`values`: the critic's, for ppo). The returns
        computed on the way (the critic's targets) are kept in `self.last_returns`."""
        args = self.args
        start = time.perf_counter()
        reset_peak_memory(self.device)
        schedule, per_sample, metrics = self._prepare(data, values)
        self.backend.synchronize()
        prepared = time.perf_counter()
        self.last_returns = per_sample.pop("returns")
        step_metrics = []
        steps = tqdm(schedule, desc=f"train {rollout_id}", unit="step", leave=False,
                     disable=self.rank != 0 or args.no_progress or len(schedule) < 2)
        replay = self.backend.routing_replay
        if args.reset_optimizer_states:  # slime: at the start of every rollout's training
            self.backend.reset_optimizer_states()
        if replay is not None and all(mb.routed_experts is not None for step in schedule for mb in step):
            replay.stage = ReplayStage.REPLAY_BACKWARD  # R3, or the routing recorded in the old-policy pass
        try:
            for step_id, micro_batches in enumerate(steps):
                if self.hooks["custom_before_train_step_hook_path"]:
                    self.hooks["custom_before_train_step_hook_path"](args, rollout_id, step_id, self.model,
                                                                     self.backend.optimizer, self.backend.scheduler)
                step_metrics.append(self._train_step(micro_batches, per_sample, self._policy_loss))
        finally:
            if replay is not None:
                replay.stage = ReplayStage.FALLTHROUGH
        if self.with_ref and args.ref_update_interval and (rollout_id + 1) % args.ref_update_interval == 0:
            self.snapshot.save("ref")  # the reference follows the actor every --ref-update-interval rollouts
        metrics.update(self._summarise(step_metrics, "train/"))
        metrics.update(train_peak_memory_metrics(self.device))
        if self.lora and self.role == "actor":  # adapter norms and size (issue #40 item 7)
            metrics.update(lora_metrics(self.backend, args.lora_adapter_names if args.lora_adapter_key else None))
        if args.save_debug_train_data:
            save_debug_train_data(args.save_debug_train_data, rollout_id,
                                  rank_train_data(data, {**per_sample, "returns": self.last_returns}), self.backend)
        self.backend.synchronize()
        # log-prob time: the no-grad passes (old / ref / teacher log-probs) and advantages; train: the steps.
        metrics["perf/log_prob_time"] = prepared - start
        metrics["perf/actor_train_time"] = time.perf_counter() - prepared
        if args.offload_train:  # after the sync above: the optimizer state leaves while the weights are pushed
            self.backend.prepare_offload()
        return metrics

    def _summarise(self, step_metrics: list[dict], prefix: str) -> dict:
        """Mean over the rollout's optimizer steps (the last lr); per-step values stay in last_step_metrics."""
        self.last_step_metrics = [{prefix + k: v for k, v in m.items()} for m in step_metrics]
        return {prefix + key: (step_metrics[-1][key] if key == "lr"
                               else sum(m[key] for m in step_metrics) / len(step_metrics))
                for key in step_metrics[0]}

    def _policy_loss(self, outputs, batch: MicroBatchTensors, reduce: LossReducer):
        log_probs, entropy = outputs
        return self.loss_fn(self.args, log_probs, entropy, batch, reduce)

    def _train_step(self, micro_batches, per_sample: dict, compute_loss) -> dict:
        """One optimizer step; compute_loss(outputs, tensors, reduce) -> (loss share, metric shares), where outputs
        are the backend's forward of the micro-batch."""
        args = self.args
        mode = aggregation_mode(args)
        step_indices = [i for mb in micro_batches for i in mb.sample_indices]
        step_masks = [per_sample["loss_masks"][i] for i in step_indices]
        shares = per_sample.get("rollout_shares")  # fan-out siblings: one rollout between them (the critic: None)
        step_shares = [shares[i] for i in step_indices] if shares else None
        denominator = torch.tensor([loss_denominator(mode, step_masks, args.loss_agg_constant, step_shares)],
                                   dtype=torch.float64, device=self.device)
        global_denominator = max(float(self._all_reduce(denominator)), 1.0)
        counts = per_sample.get("rollout_token_counts")  # the critic trains per sample

        def loss_of(index: int, outputs):
            micro_batch = micro_batches[index]
            batch = self._micro_batch_tensors(micro_batch, per_sample)
            token_counts = [counts[i] if counts else float(per_sample["loss_masks"][i].sum())
                            for i in micro_batch.sample_indices]
            return compute_loss(outputs, batch, LossReducer(args, batch.loss_masks, global_denominator, token_counts))

        self.backend.zero_grad()
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=self.device))
        for loss_metrics in self.backend.forward_backward(micro_batches, loss_of):
            for key, value in loss_metrics.items():
                sums[key] = sums[key] + torch.as_tensor(value, device=self.device).detach().double()
        keys = sorted(sums)
        reduced = self._all_reduce(torch.stack([sums[k] for k in keys])).tolist()
        metrics = dict(zip(keys, reduced))
        max_norm = args.clip_grad if args.clip_grad and args.clip_grad > 0 else math.inf
        metrics.update(self.backend.optimizer_step(max_norm))
        return metrics

    def _micro_batch_tensors(self, micro_batch, per_sample: dict) -> MicroBatchTensors:
        def flat(key):
            values = per_sample.get(key)
            if values is None:
                return None
            return to_device(torch.cat([values[i] for i in micro_batch.sample_indices]), self.device)

        total_lengths = per_sample.get("total_lengths")  # the policy's (the custom TIS hook reads them); the critic: None
        return MicroBatchTensors(
            loss_masks=[to_device(per_sample["loss_masks"][i], self.device) for i in micro_batch.sample_indices],
            advantages=flat("advantages"), old_log_probs=flat("old_log_probs"),
            ref_log_probs=flat("ref_log_probs"), rollout_log_probs=flat("rollout_log_probs"),
            old_values=flat("old_values"), returns=flat("returns"),
            old_entropy=flat("old_entropy"), ref_entropy=flat("ref_entropy"),
            total_lengths=None if total_lengths is None else [total_lengths[i] for i in micro_batch.sample_indices],
        )

    # ------------------------------------------------------------------------------- checkpoint / weights
