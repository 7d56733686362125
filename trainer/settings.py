"""The trainer's own settings, read once from their sections of the composed config (``agentloop.settings``'s
``Section`` reader: a bad value is refused naming its full key and the fix): the run's bookkeeping (``RunSettings``),
and the algorithm's (``AlgorithmSettings``), and the builders of each part's settings at the edge (the command, ``RayPPOTrainer``): the FSDP ranks'
(``rank_settings``), the rollout correction, dynamic sampling, the overlong penalty and async training. Each part
receives its own settings, never the composed config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from agentloop.settings.reading import Section
from agentloop.settings.server import ray_resources
from trainer import algorithms
from trainer.async_training import AsyncSettings
from trainer.dynamic_sampling import GroupFilter
from trainer.overlong import OverlongBuffer
from trainer.rank_settings import (
    DEVICES,
    ActorSettings,
    CriticSettings,
    ModelSettings,
    RankSettings,
    ReferenceSettings,
    log_prob_batching,
)
from trainer.rollout_correction import RolloutCorrection

RESUME_MODES = ("auto", "disable", "resume_path")
BACKENDS = ("console", "tensorboard", "wandb")


@dataclass(frozen=True)
class RunSettings:
    """A run's bookkeeping from ``trainer.*``: where it resumes from (``resume_mode``, ``resume_from_path``) and
    where its metrics go (``logger`` backends, wandb's ``project_name`` and ``experiment_name``)."""

    resume_mode: str
    resume_from_path: str | None
    logger: tuple[str, ...]
    project_name: str | None
    experiment_name: str | None

    @classmethod
    def from_section(cls, trainer: Section) -> RunSettings:
        """The run settings of ``trainer`` (the ``trainer`` section)."""
        loggers = trainer.strings("logger")
        unknown = sorted(set(loggers) - set(BACKENDS))
        if unknown:
            # the text tests and users match on: the unknown names, then the choices
            raise ValueError(f"trainer.logger names unknown backends {unknown}; choose from {list(BACKENDS)}")
        return cls(
            resume_mode=trainer.str("resume_mode", RESUME_MODES),
            resume_from_path=trainer.optional_str("resume_from_path"),
            logger=loggers,
            project_name=trainer.optional_str("project_name"),
            experiment_name=trainer.optional_str("experiment_name"),
        )

    @classmethod
    def from_config(cls, config: DictConfig) -> RunSettings:
        """Read from the composed config's ``trainer`` section (the command's edge)."""
        return cls.from_section(Section(config.get("trainer"), "trainer"))


@dataclass(frozen=True)
class KLControl:
    """``algorithm.kl_ctrl``: the KL-in-reward coefficient, fixed or adaptive (toward ``target_kl`` over ``horizon``
    samples)."""

    type: str
    kl_coef: float
    target_kl: float
    horizon: float

    @classmethod
    def from_section(cls, control: Section) -> KLControl:
        """Read and check ``algorithm.kl_ctrl``."""
        kind = control.str("type", ("fixed", "adaptive"))
        target_kl, horizon = control.float("target_kl", default=0.0), control.float("horizon", default=0.0)
        if kind == "adaptive" and not (target_kl > 0 and horizon > 0):
            raise control.error(
                "type", f"needs target_kl > 0 and horizon > 0 (got {target_kl:g}, {horizon:g})", "set both above 0"
            )
        return cls(kind, control.float("kl_coef", minimum=0.0), target_kl, horizon)


@dataclass(frozen=True)
class AlgorithmSettings:
    """``algorithm.*`` as the trainer applies it: the advantage estimator and its settings (``gamma``/``lam`` for
    GAE and the per-turn discount, GRPO's std normalisation, turn-level GRPO's and GiGPO's options), the KL penalty
    in the reward and its controller, and whether length-ended samples leave the loss (``overlong_filtering``).
    Rollout correction and dynamic sampling have settings of their own."""

    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControl
    overlong_filtering: bool
    turn_normalize: str
    gigpo_step_weight: float
    gigpo_episode_normalize: str
    gigpo_first_turn_step_advantage: bool

    @classmethod
    def from_section(cls, algorithm: Section) -> AlgorithmSettings:
        """Read and check the ``algorithm`` section."""
        for name in ("gamma", "lam"):
            if not 0 <= algorithm.float(name) <= 1:
                raise algorithm.error(
                    name,
                    "must be a number in [0, 1]",
                    "set it between 0 and 1 (gamma: the discount per token for gae, per turn for turn_grpo and gigpo)",
                )
        gigpo = algorithm.sub("gigpo")
        step_weight = gigpo.float("step_weight", minimum=0.0)
        if math.isinf(step_weight):
            raise gigpo.error("step_weight", "is infinite", "set it to a number >= 0")
        return cls(
            adv_estimator=algorithm.str("adv_estimator", algorithms.ADV_ESTIMATORS),
            gamma=algorithm.float("gamma"),
            lam=algorithm.float("lam"),
            norm_adv_by_std_in_grpo=algorithm.bool("norm_adv_by_std_in_grpo"),
            use_kl_in_reward=algorithm.bool("use_kl_in_reward"),
            kl_penalty=algorithm.str("kl_penalty", algorithms.KL_ESTIMATORS),
            kl_ctrl=KLControl.from_section(algorithm.sub("kl_ctrl")),
            overlong_filtering=algorithm.bool("overlong_filtering"),
            turn_normalize=algorithm.sub("turn_grpo").str("normalize", algorithms.TURN_NORMALIZATIONS),
            gigpo_step_weight=step_weight,
            gigpo_episode_normalize=gigpo.str("episode_normalize", algorithms.GIGPO_EPISODE_NORMALIZATIONS),
            gigpo_first_turn_step_advantage=gigpo.bool("first_turn_step_advantage"),
        )

    @classmethod
    def from_config(cls, config: DictConfig) -> AlgorithmSettings:
        """Read from the composed config's ``algorithm`` section (the command's edge)."""
        return cls.from_section(Section(config.algorithm, "algorithm"))


def rank_settings(config: DictConfig) -> RankSettings:
    """The FSDP ranks' settings; the reference's and the critic's are checked whether or not the run loads them
    (KL loss or in the reward; ``algorithm.adv_estimator=gae``)."""
    policy, algorithm = Section(config.actor_rollout_ref, "actor_rollout_ref"), Section(config.algorithm, "algorithm")
    trainer, rollout, actor_section = Section(config.trainer, "trainer"), policy.sub("rollout"), policy.sub("actor")
    actor = ActorSettings.from_section(actor_section)
    ref = ReferenceSettings.from_section(policy.sub("ref"), actor_section)
    critic = CriticSettings.from_section(Section(config.critic, "critic"))
    resources = ray_resources(trainer, "resources_per_rank")
    if "GPU" in resources:
        raise trainer.error("resources_per_rank", "cannot hold GPU", "choose the ranks' GPUs with trainer.device")
    return RankSettings(
        model=ModelSettings.from_section(policy.sub("model"), lora=True),
        actor=actor,
        samples_per_prompt=rollout.int("n", minimum=1),
        temperature=rollout.float("temperature", minimum=0.0),
        log_prob_batching=log_prob_batching(rollout, actor_section),
        ref=ref if actor.use_kl_loss or algorithm.bool("use_kl_in_reward") else None,
        critic=critic if algorithm.str("adv_estimator") == "gae" else None,
        step_timeout_s=trainer.float("step_timeout_s", positive=True),
        ranks_per_node=trainer.int("n_gpus_per_node", minimum=1),
        device=trainer.str("device", DEVICES),
        resources=resources,
    )


def rollout_correction(config: DictConfig) -> RolloutCorrection:
    """``algorithm.rollout_correction``, with the actor's older token-level keys (``RolloutCorrection.from_sections``)."""
    return RolloutCorrection.from_sections(
        Section(config.algorithm, "algorithm"), Section(config.actor_rollout_ref.actor, "actor_rollout_ref.actor")
    )


def overlong_buffer(config: DictConfig) -> OverlongBuffer | None:
    """``reward_model.overlong_buffer`` against ``data.max_response_length`` (None: off)."""
    max_length = Section(config.data, "data").int("max_response_length", minimum=1)
    return OverlongBuffer.from_section(
        Section(config.reward_model.overlong_buffer, "reward_model.overlong_buffer"), max_length
    )


def group_filter(config: DictConfig) -> GroupFilter | None:
    """``algorithm.filter_groups``, dynamic sampling (None: off), with the overlong penalty its metric may count."""
    filter_groups = Section(config.algorithm.filter_groups, "algorithm.filter_groups")
    return GroupFilter.from_section(filter_groups, overlong_buffer(config))


def async_settings(config: DictConfig) -> AsyncSettings:
    """``async_training`` for batches of ``data.train_batch_size`` groups."""
    batch = Section(config.data, "data").int("train_batch_size", minimum=1)
    return AsyncSettings.from_section(Section(config.async_training, "async_training"), batch)
