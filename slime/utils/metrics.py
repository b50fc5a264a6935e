"""Where a run's numbers go: `metrics.jsonl` (one object per rollout), TensorBoard, optionally wandb, a one-line
console summary per rollout, and a PNG plot of the key curves at the end.

Lives in the driver process only; the actors return plain dicts of floats.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path

from slime.utils.engine_access import redacted

# (panel title, metric keys drawn in it); a key that never appears is skipped.
PLOT_PANELS = [
    ("reward", ["rollout/raw_reward"]),
    ("eval", None),  # every eval/<name> key
    ("loss", ["train/loss", "train/pg_loss"]),
    ("KL", ["train/kl_loss", "train/ppo_kl"]),
    ("train/rollout mismatch", ["train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_exact_fraction",
                                "train/mismatch_ratio_outside_clip"]),
    ("response length", ["rollout/response_len/mean"]),
    ("multi-turn", ["rollout/turns_per_sample", "rollout/tool_calls_per_sample", "rollout/tool_errors_per_sample"]),
    ("staleness (fully async)", ["rollout/staleness_max", "rollout/staleness_mean", "rollout/buffer_depth",
                                 "rollout/dropped_samples"]),
    ("idle fraction", ["perf/engine_idle_fraction", "perf/trainer_idle_fraction"]),
]
SUMMARY_KEYS = [
    ("reward", "rollout/raw_reward"),
    ("loss", "train/loss"),
    ("kl", "train/kl_loss"),
    ("clip", "train/pg_clipfrac"),
    ("mismatch", "train/train_rollout_logprob_abs_diff"),
    ("len", "rollout/response_len/mean"),
    ("t_rollout", "perf/rollout_time"),
    ("t_train", "perf/train_time"),
]


def _finite_scalars(metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[key] = float(value) if isinstance(value, float) else value
    return out


def tensorboard_dir(args, output_dir: Path) -> Path:
    """<run folder>/tensorboard[/--tb-project-name[/--tb-experiment-name]]."""
    path = output_dir / "tensorboard"
    for part in (args.tb_project_name, args.tb_experiment_name):
        if part:
            path = path / part
    return path


def wandb_init_kwargs(args, output_dir: Path) -> dict:
    """wandb.init's arguments from slime's --wandb-* flags (keys redacted from the logged config)."""
    name = None
    if args.wandb_group:
        name = args.wandb_group + (f"-{secrets.token_hex(3)}" if args.wandb_random_suffix else "")
    kwargs = {"project": args.wandb_project or "slime", "entity": args.wandb_team, "group": args.wandb_group,
              "name": name, "mode": args.wandb_mode, "dir": args.wandb_dir or str(output_dir),
              "config": redacted(vars(args))}
    if args.wandb_run_id:
        kwargs.update(id=args.wandb_run_id, resume="allow")
    return kwargs


class MetricsLogger:
    def __init__(self, args):
        self.output_dir = Path(args.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.history: list[dict] = []
        self.tb_writer = None
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_writer = SummaryWriter(log_dir=str(tensorboard_dir(args, self.output_dir)))
        self.wandb = None
        if args.use_wandb:
            import wandb

            if args.wandb_key or args.wandb_host:
                wandb.login(key=args.wandb_key, host=args.wandb_host)
            wandb.init(**wandb_init_kwargs(args, self.output_dir))
            self.wandb = wandb

    def log(self, rollout_id: int, metrics: dict, print_fn=print) -> None:
        record = {"rollout_id": rollout_id, **_finite_scalars(metrics)}
        self.history.append(record)
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb_writer is not None:
            for key, value in record.items():
                if key != "rollout_id":
                    self.tb_writer.add_scalar(key, value, rollout_id)
            self.tb_writer.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=rollout_id)
        if print_fn is not None:
            print_fn(self.summary_line(record))

    @staticmethod
    def summary_line(record: dict) -> str:
        parts = [f"[rollout {record['rollout_id']}]"]
        for label, key in SUMMARY_KEYS:
            if key in record:
                parts.append(f"{label}={record[key]:.4g}")
        parts += [f"{k}={v:.3f}" for k, v in record.items() if k.startswith("eval/") and k.count("/") == 1]
        return " ".join(parts)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["rollout_id"], r[key]) for r in self.history if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    def plot(self, filename: str = "curves.png") -> Path | None:
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        eval_keys = sorted({k for r in self.history for k in r if k.startswith("eval/") and "pass@" not in k})
        panels = [(title, eval_keys if keys is None else keys) for title, keys in PLOT_PANELS]
        num_rows = -(-len(panels) // 3)
        fig, axes = plt.subplots(num_rows, 3, figsize=(15, 4 * num_rows))
        for ax, (title, keys) in zip(axes.flat, panels):
            for key in keys:
                xs, ys = self.series(key)
                if xs:
                    ax.plot(xs, ys, marker="o", markersize=3, label=key)
            ax.set_title(title)
            ax.set_xlabel("rollout")
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = self.output_dir / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.plot()
        if self.tb_writer is not None:
            self.tb_writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_args(args) -> None:
    path = Path(args.output_dir) / "args.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(redacted(vars(args)), indent=1, default=str))
