"""slime's data, eval, network and rollout-buffer flags beyond the core groups of `arguments.py`.

Registration only. `--eval-config` is read by `slime.utils.eval_config`; the rollout-buffer values are read by
rollout functions that talk to slime's external trajectory buffer.
"""

from __future__ import annotations

from slime.config.flags_weight_sync import _json_object


def add_rollout_extra_arguments(parser):
    g = parser.add_argument_group("data and eval (more of slime's)")
    g.add_argument("--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset",
                   help="no --prompt-data: the data source hands out empty Samples for the rollout function to fill")
    g.add_argument("--apply-chat-template-kwargs", type=_json_object, default={},
                   help="JSON object of extra keyword arguments to apply_chat_template, e.g. "
                        "'{\"enable_thinking\": false}'")
    g.add_argument("--multimodal-keys", type=_json_object, default=None,
                   help="JSON map from modality to the data column holding its items, e.g. '{\"image\": \"images\"}'"
                        " (images only): each <image> in the prompt takes the next item (a path, file:// URL or "
                        "base64); needs --apply-chat-template and a Qwen2.5-VL / Qwen3-VL --hf-checkpoint")
    g.add_argument("--eval-config", default=None, metavar="YAML",
                   help="multi-dataset eval: eval: {defaults: {...}, datasets: [{name, path, ...}]} (overrides "
                        "--eval-prompt-data); per-dataset keys are those of slime.utils.eval_config")
    g.add_argument("--eval-tool-key", default=None)
    g.add_argument("--eval-max-prompt-len", type=int, default=None)
    g.add_argument("--eval-min-new-tokens", type=int, default=None)
    g.add_argument("--eval-max-context-len", type=int, default=None)
    g.add_argument("--http-proxy", default=None)
    g.add_argument("--use-distributed-post", action="store_true")
    g.add_argument("--rollout-buffer-url", default=None)
    g.add_argument("--fetch-trajectory-retry-times", type=int, default=-1)
    g.add_argument("--min-batch-collection-ratio", type=float, default=1)
    g.add_argument("--rollout-task-type", default="math")
