"""The trainer's own settings, read once from their sections of the composed config (``agentloop.settings``'s
``Section`` reader: a bad value is refused naming its full key and the fix)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from agentloop.settings.reading import Section

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
