"""The trainer of one training process: the train flow over the backend `--train-backend` names (fsdp, megatron),
or the PPO critic's flow. Backends are imported here only, inside the process that trains, so the driver never
imports torch's distributed stack or megatron-core."""

from __future__ import annotations


def create_trainer(args, rank: int, world_size: int, master_addr: str, master_port: int, role: str = "actor"):
    if role not in ("actor", "critic"):
        raise ValueError(f"unknown train group role {role!r}; expected actor or critic")
    if args.train_backend == "megatron":
        if role == "critic":
            raise ValueError("--train-backend megatron trains no critic yet; use --train-backend fsdp for ppo")
        from slime.backends.megatron_utils.backend import MegatronBackend
        from slime.backends.train_flow import TrainFlow
        from slime.utils.megatron_role_config import role_args

        args = role_args(args, "actor")  # --megatron-config-path: the actor's overrides

        return TrainFlow(args, MegatronBackend(args, rank, world_size, master_addr, master_port),
                         master_addr=master_addr)
    if args.train_backend != "fsdp":
        raise ValueError(f"unknown --train-backend {args.train_backend!r}; choose fsdp or megatron")
    from slime.backends.fsdp_utils.backend import FSDPBackend

    backend = FSDPBackend(args, rank, world_size, master_addr, master_port)
    if role == "critic":
        from slime.backends.fsdp_utils.critic import FSDPCritic

        return FSDPCritic(args, backend, master_addr=master_addr)
    from slime.backends.train_flow import TrainFlow

    return TrainFlow(args, backend, master_addr=master_addr)
