"""Judges and reward models served beside the policy (``reward_model.*``): the servers (``pool``), the workers'
client (``client``), the running sample's judge and the record of its calls (``session``) and the discriminative
reward model's server (``reward_model_server``)."""

from agentloop.judge.client import Judge, judge_session
from agentloop.judge.session import JudgeCall, JudgeError, JudgeUnparsable

__all__ = ["Judge", "JudgeCall", "JudgeError", "JudgeUnparsable", "judge_session"]
