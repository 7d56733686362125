"""Judges and reward models served beside the policy (``reward_model.*``): the servers (``pool``), the workers'
client (``client``) and the discriminative reward model's server (``reward_model_server``)."""

from agentloop.judge.client import Judge, JudgeCall, JudgeError, JudgeUnparsable, active_judge, current_judge, judge_session

__all__ = ["Judge", "JudgeCall", "JudgeError", "JudgeUnparsable", "active_judge", "current_judge", "judge_session"]
