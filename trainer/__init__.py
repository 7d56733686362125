"""FSDP PPO/GRPO trainer that consumes agentloop's padded rollout batches (entry point: ``trainer.main_ppo``)."""

# agentloop sets OpenMP's wait policy as it loads, and only a setting made before torch loads counts: imported
# first here, it reaches a rank's process in a Ray cluster this job joins, whose workers' environment is not ours
import agentloop  # noqa: F401
