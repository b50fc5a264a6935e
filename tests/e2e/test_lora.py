"""train.py end to end with --lora-rank on the CPU (real Ray, the built-in engine behind the real router): the
engines serve every pushed adapter version (the engine's log-probs equal the trainer's after every push while the
policy moves away from the frozen base, the reference), only adapter-sized pushes travel, and a checkpoint holds a
PEFT adapter, with the LoRA metrics in metrics.jsonl; the same on an engine of two ranks; two adapters in one run
serve each sample its own adapter; the quickstart's held-out accuracy rises with a LoRA GRPO phase, and two adapters
each learn their own task (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train import REPO, read_metrics, run_train

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from examples.quickstart.task import build_task

    return build_task(tmp_path_factory.mktemp("task"), seed=0)


MEGATRON_TP2 = ("--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")


@pytest.mark.parametrize("layout", [
    pytest.param((), id="fsdp"),
    pytest.param(MEGATRON_TP2, id="megatron_tp2", marks=pytest.mark.slow),  # ~4 min on 2 cores
    # one engine of two ranks colocated with the two trainer ranks: each engine rank holds its adapter shard
    pytest.param(("--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "2"),
                 id="fsdp_engine_tp2"),
])
def test_lora_grpo_run_serves_every_pushed_adapter(task, tmp_path, layout):
    if "megatron" in layout:
        pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    run_train([
        *layout,
        "--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "4",
        "--custom-rm-path", "tests.helpers.e2e_rewards.sample_index_parity",  # rewards that vary: the policy moves
        "--n-samples-per-prompt", "4", "--num-rollout", "3", "--rollout-max-response-len", "8",
        "--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--lr", "2e-2",
        "--use-kl-loss", "--kl-loss-coef", "0.0", "--check-lora-weight-equal",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--output-dir", str(out), "--no-progress",
    ])
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3  # the engine served the trainer's adapter
        assert row["perf/weight_push_gb"] < 0.01  # the adapter alone (the base is ~100x larger)
    assert rows[0]["train/kl_loss"] == 0.0  # adapter B = 0: policy == base
    assert rows[2]["train/kl_loss"] > 1e-4  # the policy moved away from the base, and the engines followed
    megatron = "megatron" in layout
    folder = "iter_0000002" if megatron else "rollout_2"  # Megatron-LM's checkpoint layout, the FSDP backend's
    adapter = tmp_path / "ckpt" / folder / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and (adapter / "adapter_model.safetensors").is_file()
    check_lora_metrics(rows, task["model"], adapter, megatron=megatron)


def expected_trainable_params(model_dir, rank: int, megatron: bool) -> int:
    """All-linear adapters of the checkpoint's shape: A [r, in] and B [out, r] per layer; Megatron's fused q/k/v and
    gate/up layers hold one A each (lora.py)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    a_inputs = [hidden, q, hidden, inter] if megatron else [hidden] * 3 + [q, hidden, hidden, inter]
    b_outputs = [q + 2 * kv, hidden, 2 * inter, hidden] if megatron else [q, kv, kv, hidden, inter, inter, hidden]
    return config["num_hidden_layers"] * rank * (sum(a_inputs) + sum(b_outputs))


def check_lora_metrics(rows, model_dir, adapter_dir, megatron: bool) -> None:
    """Issue #40 item 7 in metrics.jsonl: trainable parameters, adapter norms (equal to the saved adapter's), push
    bytes and seconds, peak memory."""
    from safetensors.torch import load_file

    for row in rows:
        assert row["lora/trainable_params"] == expected_trainable_params(model_dir, 8, megatron)
        assert row["lora/adapter_norm"] ** 2 == pytest.approx(row["lora/lora_A_norm"] ** 2 + row["lora/lora_B_norm"] ** 2)
        assert row["lora/lora_B_norm"] > 0  # B starts at zero; the metric follows the training step
        assert row["perf/weight_push_time"] > 0 and row["perf/train_peak_memory_gb"] > 0.1
        if not megatron:  # the pushed tensors are the trainable ones, in fp32 (the CPU engine's dtype)
            assert row["perf/weight_push_gb"] * 1e9 == pytest.approx(4 * row["lora/trainable_params"])
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for kind in ("lora_A", "lora_B"):
        norm = sum(float(t.double().square().sum()) for name, t in saved.items() if f".{kind}." in name) ** 0.5
        assert rows[-1][f"lora/{kind}_norm"] == pytest.approx(norm, rel=1e-6)
    assert rows[-1]["lora/lora_B_norm"] > rows[0]["lora/lora_B_norm"]


@pytest.mark.slow  # the quickstart: full SFT warm start, then 80 LoRA GRPO rollouts (~10 min or more on 2 cores)
def test_quickstart_with_lora_grpo_raises_held_out_accuracy(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "examples/quickstart/run.py"), "--out-dir", str(tmp_path), "--lora-rank", "16"],
        cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["eval_accuracy_after_rl"] > summary["eval_accuracy_before_rl"]


def test_two_adapter_run_serves_each_sample_its_own_adapter(tmp_path):
    """--lora-adapter-key: each prompt's adapter trains on its own samples and the engines serve every sample the
    version of its own adapter (the engine's log-probs equal the trainer's once the adapters differ); pushes, metrics
    and the checkpoint come per adapter."""
    from examples.lora_multi.task import build_two_tasks

    task = build_two_tasks(tmp_path / "task", seed=0)
    out = tmp_path / "run"
    run_train([
        "--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "4",
        "--custom-rm-path", "tests.helpers.e2e_rewards.sample_index_parity",  # rewards that vary: the policy moves
        "--n-samples-per-prompt", "4", "--num-rollout", "3", "--rollout-max-response-len", "8",
        "--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--lr", "2e-2",
        "--lora-adapter-key", "task", "--lora-adapter-names", "add,sub", "--check-lora-weight-equal",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--output-dir", str(out), "--no-progress",
    ])
    rows = read_metrics(out)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/train_rollout_logprob_abs_diff"] < 1e-3  # every sample got its own adapter's version
        assert row["perf/weight_push_buckets"] == 2  # one load per adapter
        assert row["rollout/add/num_samples"] == row["rollout/sub/num_samples"] == 8  # the rows alternate
        for name in ("add", "sub"):
            assert row[f"lora/{name}/adapter_norm"] ** 2 == pytest.approx(
                row[f"lora/{name}/lora_A_norm"] ** 2 + row[f"lora/{name}/lora_B_norm"] ** 2)
        assert row["lora/adapter_norm"] ** 2 == pytest.approx(
            row["lora/add/adapter_norm"] ** 2 + row["lora/sub/adapter_norm"] ** 2)
    from safetensors.torch import load_file

    saved = {}
    for name in ("add", "sub"):
        folder = tmp_path / "ckpt" / "rollout_2" / "adapter" / name
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
        saved[name] = load_file(str(folder / "adapter_model.safetensors"))
    assert saved["add"].keys() == saved["sub"].keys()
    # the adapters trained apart: their B (zero at the start) differ as much as they are large
    difference = sum(float((saved["add"][k] - saved["sub"][k]).square().sum()) for k in saved["add"] if "lora_B" in k)
    size = sum(float(saved["add"][k].square().sum()) for k in saved["add"] if "lora_B" in k)
    assert difference > 0.5 * size


@pytest.mark.slow  # a full SFT warm start, then 60 GRPO rollouts training two adapters (~10 min or more on 2 cores)
def test_two_adapters_each_learn_their_own_task(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples/lora_multi/run.py"), "--out-dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for task in ("add", "sub"):  # each adapter, evaluated on its own task's held-out problems, improved
        before, after = summary[task]
        assert after > before + 0.05, (task, summary)
    from safetensors.torch import load_file

    from slime.utils.checkpoint_state import latest_checkpoint

    folder = latest_checkpoint(Path(summary["run_dir"]) / "grpo") / "adapter"
    add, sub = (load_file(str(folder / task / "adapter_model.safetensors")) for task in ("add", "sub"))
    difference = sum(float((add[k] - sub[k]).square().sum()) for k in add if "lora_B" in k)
    assert difference > 0.5 * sum(float(add[k].square().sum()) for k in add if "lora_B" in k)  # they differ
