"""FSDP PPO/GRPO trainer that consumes agentloop's padded rollout batches (entry point: ``trainer.main_ppo``)."""
