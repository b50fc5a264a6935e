"""The trainer of one training process: the policy's train flow or the PPO critic's flow, over the backend
`--train-backend` names (fsdp, megatron). Backends are imported here only, inside the process that trains, so the
driver never imports torch's distributed stack or megatron-core."""

from __future__ import annotations


def create_trainer(args, rank: int, world_size: int, master_addr: str, master_port: int, role: str = "actor"):
    if role not in ("actor", "critic"):
        raise ValueError(f"unknown train group role {role!r}; expected actor or critic")
    if args.train_backend == "megatron":
        from slime.backends.megatron_utils.backend import MegatronBackend
        from slime.config.megatron_role_config import role_args

        args = role_args(args, role)  # --megatron-config-path: the role's overrides
        backend = MegatronBackend(args, rank, world_size, master_addr, master_port)
    elif args.train_backend == "fsdp":
        from slime.backends.fsdp_utils.backend import FSDPBackend

        backend = FSDPBackend(args, rank, world_size, master_addr, master_port)
    else:
        raise ValueError(f"unknown --train-backend {args.train_backend!r}; choose fsdp or megatron")
    if role == "critic":
        from slime.backends.critic_flow import CriticFlow

        return CriticFlow(args, backend, master_addr=master_addr)
    from slime.backends.train_flow import TrainFlow

    return TrainFlow(args, backend, master_addr=master_addr)
