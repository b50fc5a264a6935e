"""The built-in inference engine's Python API: add requests, step the continuous-batching loop, abort, update
weights (versioned), release / resume memory, and a blocking `generate`.

Single-threaded and synchronous: the HTTP server (`server/app.py`) drives `step()` from its own loop. Composes the
scheduler, block manager, model runner and sampler; finish rules for text (stop strings) and detokenization
happen here. Not an HTTP layer and not a multi-process launcher.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import uuid
from pathlib import Path

from slime.engine.block_manager import BlockManager
from slime.engine.config import Config
from slime.engine.engine_images import EngineImages
from slime.engine.engine_weights import EngineWeights
from slime.engine.lora.engine_lora import EngineLora
from slime.engine.memory_tags import EngineMemoryReleasedError, EngineWeightsMissingError, memory_tags
from slime.engine.mla_checks import check_mla_engine_config
from slime.engine.model_runner import ModelRunner
from slime.engine.models import load_model_config
from slime.engine.overlap import OverlappedStepping
from slime.engine.parallel.rank_weights import RankWeights
from slime.engine.request_output import RequestOutput
from slime.engine.sampling_params import as_sampling_params
from slime.engine.scheduled_batch import sampled_seqs
from slime.engine.scheduler import Scheduler
from slime.engine.sequence import FINISHED, Sequence, SequenceStatus
from slime.engine.stop_strings import FinalText, decode_final_texts, find_new_stop

logger = logging.getLogger(__name__)


class Engine(EngineWeights, EngineLora, EngineImages, OverlappedStepping):
    def __init__(self, model_path: str, **config):
        from transformers import AutoTokenizer

        self.config = Config.from_kwargs(str(model_path), **config)
        self.model_config = load_model_config(self.config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.eos_token_ids = self._eos_token_ids()
        check_mla_engine_config(self.config, self.model_config)
        self.vl_processor = self._vl_processor()
        self.ranks = None  # a sharded engine's other ranks (parallel/ranks.py)
        if self.config.tp_size > 1:
            self._start_ranks()
        else:
            self.model_runner = ModelRunner(self.config, self.model_config, self.eos_token_ids)
        self.rank_weights = RankWeights(self.model_runner, 0)
        # every rank's weight version and checksum (of the last push)
        self.rank_reports = [self.rank_weights.report(), *(self.ranks.call("weights.report") if self.ranks else [])]
        self.rank_mismatch: str | None = None  # why the ranks' weights differ after a failed push (generation refused)
        if self.config.overlap_schedule is None:
            self.config.overlap_schedule = self.model_runner.device.type == "cuda"
        max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        if max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({self.model_config.max_position_embeddings})"
            )
        # One sequence must always fit in the KV cache, or preemption could never make progress.
        self.max_model_len = min(max_model_len, self.model_runner.num_kvcache_blocks * self.config.kvcache_block_size)
        if self.ranks is not None:
            largest = self.model_runner.num_kvcache_blocks * self.config.kvcache_block_size // self.max_model_len
            logger.info("engine of %d ranks: %d KV blocks per rank (the smallest rank's), at most %d sequences of %d "
                        "tokens at once", self.config.tp_size, self.model_runner.num_kvcache_blocks,
                        min(self.config.max_num_seqs, largest), self.max_model_len)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, self.config.kvcache_block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
            self.eos_token_ids,
            on_finish=self._on_finish,
        )
        self.model_runner.warm_up(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.rng = random.Random(self.config.seed)
        self.requests: dict[str, Sequence] = {}
        # Unfinished requests a step looks at one by one (rid -> reported after every token): the incremental
        # ones and those with stop strings to check. The others cost a step only the scheduler's bookkeeping.
        self.watched: dict[str, bool] = {}
        self.pending_outputs: list[RequestOutput] = []
        self.in_flight = None  # overlapped scheduling: (scheduled batch, its LaunchedStep)
        # Batches launched so far: a step that reports nothing (no request finished, none streams) but launched a
        # batch still made progress.
        self.num_launched_steps = 0
        self.released_tags: set[str] = set()
        self.weight_version = "0"
        self.num_weight_updates = 0
        # Text of running requests, decoded only when a consumer reads it; keyed by skip_special_tokens.
        self._detokenizers = {
            skip: functools.partial(_decode, self.tokenizer, skip_special_tokens=skip) for skip in (False, True)
        }

    def _eos_token_ids(self) -> set[int]:
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        generation_config = Path(self.config.model) / "generation_config.json"
        if generation_config.is_file():
            value = json.loads(generation_config.read_text()).get("eos_token_id")
            eos.update([value] if isinstance(value, int) else (value or []))
        return eos

    # ---- requests -----------------------------------------------------------------------------------------------

    def _start_ranks(self) -> None:
        """tp_size > 1: spawn ranks 1..N-1, build rank 0's shard beside theirs, log what each rank holds."""
        from slime.engine.parallel.ranks import EngineRanks
        from slime.engine.parallel.worker import rank_info

        if self.config.overlap_schedule:
            raise ValueError("overlap_schedule is not supported with tp_size > 1 (--tp-size): the other ranks follow "
                             "rank 0's plan step by step; leave overlap_schedule unset or false")
        self.config.overlap_schedule = False
        self.ranks = EngineRanks(self.config, self.eos_token_ids)
        self.model_runner = ModelRunner(self.config, self.model_config, self.eos_token_ids, self.ranks.parallel)
        reports = [{"rank": 0, **rank_info(self.model_runner)}, *self.ranks.wait_ready()]
        self.model_runner.plan = self.ranks
        for report in reports:
            logger.info("engine rank %d of %d: weights %.1f MiB, KV cache %d blocks of %d bytes", report["rank"],
                        self.config.tp_size, report["weight_bytes"] / 2**20, report["kv_blocks"],
                        report["kv_bytes_per_block"])

    def shutdown(self) -> None:
        """Stop the other ranks of a sharded engine (nothing to do at one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def add_request(
        self, prompt_token_ids: list[int], sampling_params=None, rid: str | None = None, incremental: bool = True,
        return_routed_experts: bool = False, lora_name: str | None = None, images=None,
    ) -> str:
        """Queue a request; returns its rid. `incremental`: `step()` reports it after every token it gets; False:
        only its finished output (a consumer that waits for the end then costs the engine nothing per step).
        With `return_routed_experts` its finished output carries the MoE routing of every position but the last
        (needs the engine's enable_return_routed_experts). `lora_name`: a loaded LoRA adapter to generate with
        (None: the base model). `images` (a VL model): image references (paths, file URLs, base64, PIL) in order,
        each one image-pad token in `prompt_token_ids` (expanded here) or already the processor's expansion."""
        self._check_resident("add a request")
        params = as_sampling_params(sampling_params)
        if return_routed_experts and not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs an engine started with enable_return_routed_experts "
                             "(the server flag --enable-return-routed-experts; slime sets it for "
                             "--use-rollout-routing-replay)")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab_size = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one output token"
            )
        rid = rid if rid is not None else uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"rid {rid!r} is already in use by an unfinished request")
        seed = params.sampling_seed if params.sampling_seed is not None else self.rng.getrandbits(32)
        image_prompt = None
        if images or (self.vl_processor is not None and self.vl_processor.image_token_id in prompt_token_ids):
            prompt_token_ids, image_prompt = self._image_prompt(prompt_token_ids, images or [])
        seq = Sequence(rid, list(prompt_token_ids), params, seed % 2**32)
        seq.image_prompt = image_prompt
        seq.return_routed_experts = return_routed_experts
        self._attach_lora(seq, lora_name)  # an unknown adapter name is refused here
        if params.max_new_tokens == 0:
            self._detach_lora(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, {"type": "length", "length": 0}
            self.pending_outputs.append(self._output(seq))
            return rid
        self.requests[rid] = seq
        if incremental or params.stop:
            self.watched[rid] = incremental
        self.scheduler.add(seq)
        return rid

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pending_outputs or self.in_flight)

    def abort_request(self, rid: str) -> RequestOutput | None:
        """Finish `rid` with reason abort and free its blocks. Returns its final output (partial tokens and
        log-probs), which `step()` will not report again; None if `rid` is unknown or already finished."""
        self._drain()
        seq = self.requests.pop(rid, None)
        if seq is None:
            return None
        self.watched.pop(rid, None)
        self.pending_outputs = [output for output in self.pending_outputs if output.rid != rid]
        self.scheduler.abort(seq)
        return self._output(seq)

    def abort_all(self) -> list[RequestOutput]:
        return [self.abort_request(rid) for rid in list(self.requests)]

    def step(self) -> list[RequestOutput]:
        """One scheduler step: forward the scheduled batch, sample, apply stop rules. Returns the outputs of the
        requests that made progress (a new token or finished).

        With `overlap_schedule`, a step launches the next decode batch before it waits for the one in flight, so
        its outputs are those of the batch launched by the previous call."""
        if self.scheduler.has_unfinished():
            self._check_resident("generate")
        outputs, self.pending_outputs = self.pending_outputs, []
        if self.config.overlap_schedule:
            return outputs + self._overlapped_step()
        if not self.scheduler.has_unfinished():
            return outputs
        scheduled = self.scheduler.schedule()
        assert scheduled, "scheduler made no progress with unfinished requests"
        self.num_launched_steps += 1
        return outputs + self._complete(scheduled, self._launch(scheduled))

    def _complete(self, scheduled, launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens, apply them and the stop rules; the outputs of its finished requests
        and of its watched (incremental) ones that got a token."""
        token_ids, log_probs = self.model_runner.collect(launched)
        finished = self.scheduler.postprocess(scheduled, token_ids, log_probs)
        running = []
        if self.watched:
            watched = self.watched
            for seq in sampled_seqs(scheduled):
                if seq.status is FINISHED:
                    continue
                incremental = watched.get(seq.rid)
                if incremental is None:
                    continue
                if seq.sampling_params.stop:
                    stop = find_new_stop(self.tokenizer, seq.output_token_ids, seq.sampling_params)
                    if stop is not None:
                        self.scheduler.finish(seq, {"type": "stop", "matched": stop})
                        finished.append(seq)
                        continue
                if incremental:
                    running.append(seq)
        for seq in finished:
            self.requests.pop(seq.rid, None)
            self.watched.pop(seq.rid, None)
        return [self._output(seq) for seq in running] + [self._output(seq) for seq in finished]

    def _on_finish(self, seq: Sequence) -> None:
        self._read_routed_experts(seq)
        self._detach_lora(seq)

    def _read_routed_experts(self, seq: Sequence) -> None:
        """At finish, while `seq` holds its blocks: the routing of positions [0, len - 1) (the last token never went
        through the model); an abort mid-prefill has only its computed positions."""
        if seq.return_routed_experts:
            num_positions = min(len(seq) - 1, seq.num_computed_tokens)
            seq.routed_experts = self.model_runner.read_routed_experts(seq.block_table, num_positions)

    def _output(self, seq: Sequence) -> RequestOutput:
        """O(1): a snapshot of the sequence, sliced when read. Its text, a finished request's final text (trimmed at
        its stop) included, is decoded when first read, by the consumer (stop_strings.decode_final_texts)."""
        finished = seq.status is FINISHED
        detokenize = (FinalText(self.tokenizer, seq) if finished
                      else self._detokenizers[seq.sampling_params.skip_special_tokens])
        return RequestOutput(
            seq.rid,
            seq.token_ids,
            seq.num_prompt_tokens,
            seq.output_log_probs,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            weight_version=self.weight_version,
            detokenize=detokenize,
            routed_experts=seq.routed_experts,
            prompt_token_ids=None if seq.image_prompt is None else seq.image_prompt.prompt_token_ids,
        )

    def generate(self, prompts_or_token_ids, sampling_params=None) -> list[dict]:
        """Blocking: run the given prompts (strings or token-id lists) to completion; results in input order."""
        if isinstance(prompts_or_token_ids, str) or (
            isinstance(prompts_or_token_ids, list) and prompts_or_token_ids and isinstance(prompts_or_token_ids[0], int)
        ):
            prompts_or_token_ids = [prompts_or_token_ids]
        if not isinstance(prompts_or_token_ids, (list, tuple)) or not prompts_or_token_ids:
            raise ValueError("prompts_or_token_ids must be a non-empty list of strings or of token-id lists")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts_or_token_ids):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {len(prompts_or_token_ids)} prompts"
                )
            params_list = [as_sampling_params(p) for p in sampling_params]
        else:
            params_list = [as_sampling_params(sampling_params)] * len(prompts_or_token_ids)
        rids = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, params in zip(prompts_or_token_ids, params_list):
                token_ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
                rids.append(self.add_request(token_ids, params, incremental=False))
            while not results.keys() >= set(rids):
                for output in self.step():
                    if output.finished:
                        results[output.rid] = output
        except BaseException:
            for rid in rids:  # leave no orphaned requests behind
                self.abort_request(rid)
            raise
        decode_final_texts(list(results.values()))
        return [results[rid].to_dict() for rid in rids]

    def flush_cache(self) -> bool:
        """Forget all cached prefixes; KV written before this call is never reused. Always succeeds."""
        self._drain()
        self.block_manager.flush()
        return True

    # ---- memory -------------------------------------------------------------------------------------------------

    def release_memory(self, tags=None, discard_weights: bool = False) -> None:
        """Free device memory for `tags` (default all). Running requests are preempted and recompute on resume.
        `discard_weights`: the caller loads every weight before the next generation, so the weights are dropped,
        not copied to the host, and the engine refuses to generate until all are loaded again."""
        tags = memory_tags(tags)
        if discard_weights and "weights" not in tags:
            raise ValueError(f"discard_weights needs the 'weights' tag among the released tags, got {tags}")
        self._drain()
        self.model_runner.park_graphs(keep="cuda_graph" not in tags)
        try:
            if "kv_cache" in tags and "kv_cache" not in self.released_tags:
                for seq in list(self.scheduler.running):
                    self.scheduler.preempt(seq)
                self.flush_cache()
                self.model_runner.free_kv_cache()
            if "weights" in tags and not self.model_runner.host_weights.released:  # a second release: a no-op
                self.model_runner.release_weights(set(self.named_weight_shapes()) if discard_weights else None)
        except BaseException:
            self.model_runner.clear_parked_graphs()  # not both back for sure: the next steps capture anew
            raise
        self.released_tags |= set(tags)

    def resume_memory(self, tags=None) -> None:
        tags = memory_tags(tags)
        if "weights" in tags:
            self.model_runner.resume_weights()
        if "kv_cache" in tags and "kv_cache" in self.released_tags:
            self.model_runner.allocate_kv_cache()
        self.released_tags -= set(tags)
        if not self.released_tags & {"weights", "kv_cache"}:
            held = self.model_runner.unpark_graphs()
            if self.ranks is not None and any(tuple(other) != held for other in self.ranks.last_results):
                self.model_runner.drop_graphs()  # some rank lost its graphs: all capture anew together

    @property
    def weights_missing(self) -> set[str]:
        """Checkpoint names not loaded since a release that discarded the weights (empty: the weights are valid)."""
        return self.model_runner.host_weights.missing

    def _check_resident(self, action: str, tags=("weights", "kv_cache"), needs_valid_weights: bool = True) -> None:
        released = sorted(self.released_tags & set(tags))
        if released:
            raise EngineMemoryReleasedError(f"cannot {action}: memory {released} is released; call resume_memory first")
        if needs_valid_weights and self.rank_mismatch:
            raise EngineWeightsMissingError(f"cannot {action}: the engine's ranks hold different weights after a failed "
                                            f"push ({self.rank_mismatch}); push every weight again first")
        if needs_valid_weights and self.weights_missing:
            missing = sorted(self.weights_missing)
            raise EngineWeightsMissingError(
                f"cannot {action}: the weights were discarded by a release with discard_weights and {len(missing)} "
                f"are not loaded again (e.g. {missing[0]!r}); push every weight (update_weights_from_tensor / "
                "_distributed / _disk) first")


def _decode(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
