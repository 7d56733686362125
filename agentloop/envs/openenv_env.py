"""``OpenEnvEnv``: an OpenEnv environment (``openenv-core``: Meta's and Hugging Face's environment hub) as a
``BaseEnv`` for ``env_agent``, unedited: in-process (its ``Environment`` class, built per sample) or over its server
(an ``EnvClient``, one WebSocket session per sample; ``GenericEnvClient`` unless the env names its own client).

Name it as an env class (``rollout.env.class_name`` or the row's ``extra_info.env_kwargs.class_name``:
``agentloop.envs.openenv_env.OpenEnvEnv``) with these ``env_kwargs`` (``rollout.env.config`` gives defaults):

- ``environment``: the dotted path of its ``Environment`` subclass, run in the worker (``environment_kwargs`` build
  it); or ``base_url``: its server's URL (``http://127.0.0.1:8000``), with ``client`` the dotted path of its
  ``EnvClient`` subclass (default ``openenv.core.GenericEnvClient``) and ``message_timeout_s`` (default 60);
- ``action``: the dotted path of its ``Action`` subclass (needed in-process and by a typed client), and
  ``action_field``: the action's field the model's reply fills (default: the action class's one required field);
- ``observation_field``: the observation's field shown to the model (default: its fields but ``done``, ``reward``
  and ``metadata``: one field's text, or several as JSON);
- ``reset_kwargs``: passed to ``reset`` (``seed``, ``episode_id``...).

What maps to what: ``reset``'s observation opens the episode (a user message after the row's prompt); each model
turn is an action, its step's observation the next user message, its ``reward`` the turn's reward
(``info["reward"]``, ``TurnRecord.env_reward``), its ``done`` the trajectory's end. An observation that is not one
(no ``done``, a ``reward`` that is not a number) raises ``MalformedObservation``; that, a step that raises or outlives
``rollout.env.step_timeout_s``, or a server that died, is retried as ``env_agent`` retries a step (reset, replay), then
ends the trajectory (``env_error``, the failures counted by kind); a ``reset`` that fails fails the sample.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

from hydra.utils import get_class

from agentloop.envs.base import BaseEnv

HIDDEN_FIELDS = ("done", "reward", "metadata")


class MalformedObservation(ValueError):
    """What an OpenEnv environment returned is not an observation with ``done`` and a numeric (or no) ``reward``."""


class OpenEnvEnv(BaseEnv):
    """One episode of an OpenEnv environment, in-process or over its server (see the module's docstring)."""

    def __init__(
        self,
        environment: str | None = None,
        base_url: str | None = None,
        client: str = "openenv.core.GenericEnvClient",
        action: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        environment_kwargs: dict[str, Any] | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        message_timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if bool(environment) == bool(base_url):
            raise ValueError(
                "OpenEnvEnv needs exactly one of env_kwargs.environment (the dotted path of an OpenEnv Environment, "
                f"run in-process) and env_kwargs.base_url (its server's URL); got {environment=}, {base_url=}"
            )
        self.action_class = _import(action, "action") if action else None
        if environment and self.action_class is None:
            raise ValueError("OpenEnvEnv in-process needs env_kwargs.action: the dotted path of its Action class")
        self.action_field = action_field or _only_required_field(self.action_class)
        self.observation_field = observation_field
        self.reset_kwargs = dict(reset_kwargs or {})
        self.environment_class = _import(environment, "environment") if environment else None
        self.environment_kwargs = dict(environment_kwargs or {})
        self.client_class = None if environment else _import(client, "client")
        self.base_url, self.message_timeout_s = base_url, float(message_timeout_s)
        self.episode: Any = None  # the Environment, or the connected client

    def reset(self) -> str:
        """Start an episode (a fresh environment, or a new session at the server); its opening observation."""
        self.close()
        if self.environment_class is not None:
            self.episode = self.environment_class(**self.environment_kwargs)
            return self._read(self.episode.reset(**self.reset_kwargs))[0]
        self.episode = self.client_class(base_url=self.base_url, message_timeout_s=self.message_timeout_s)
        self.episode.connect()
        return self._read(self.episode.reset(**self.reset_kwargs))[0]

    def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        fields = {self.action_field: response_text}
        action = self.action_class(**fields) if self.action_class is not None else fields
        observation, reward, done = self._read(self.episode.step(action))
        return observation, done, {"reward": reward}

    def close(self) -> None:
        """End the episode: the environment's ``close``, or the client's session at the server."""
        episode, self.episode = self.episode, None
        if episode is not None:
            episode.close()

    def _read(self, result: Any) -> tuple[str, float, bool]:
        """The observation's text, reward and done, from an in-process ``Observation`` or a client's ``StepResult``."""
        if hasattr(result, "model_dump") and hasattr(result, "done"):  # an in-process Observation
            fields, reward, done = result.model_dump(), getattr(result, "reward", None), result.done
        elif hasattr(result, "observation") and hasattr(result, "done"):  # a client's StepResult
            observation = result.observation
            fields = observation.model_dump() if hasattr(observation, "model_dump") else observation
            reward, done = result.reward, result.done
        else:
            raise MalformedObservation(f"not an OpenEnv observation or step result: {result!r:.200}")
        if not isinstance(fields, dict) or not isinstance(done, bool):
            raise MalformedObservation(f"an observation needs fields and a boolean done; got {result!r:.200}")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
            raise MalformedObservation(f"an observation's reward must be a number or None; got {reward!r:.200}")
        return self._text(fields), float(reward or 0.0), done

    def _text(self, fields: dict[str, Any]) -> str:
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise MalformedObservation(
                    f"the observation has no field {self.observation_field!r} (env_kwargs.observation_field); "
                    f"its fields: {sorted(fields)}"
                )
            return str(fields[self.observation_field])
        shown = {key: value for key, value in fields.items() if key not in HIDDEN_FIELDS}
        if len(shown) == 1:
            return str(next(iter(shown.values())))
        return json.dumps(shown, sort_keys=True, default=str)


def _import(path: str, key: str) -> Any:
    try:
        return get_class(path)
    except Exception as error:
        raise ValueError(f"OpenEnvEnv: env_kwargs.{key}={path!r} cannot be imported: {error}") from error


def _only_required_field(action_class: Any) -> str:
    """The one required field of an Action class: where the model's reply goes."""
    if action_class is None:
        raise ValueError("OpenEnvEnv over a GenericEnvClient needs env_kwargs.action_field (or env_kwargs.action)")
    required = [name for name, field in action_class.model_fields.items() if field.is_required()]
    if len(required) != 1:
        raise ValueError(
            f"OpenEnvEnv: {action_class.__name__} has required fields {required}; name the one the model's reply "
            "fills with env_kwargs.action_field"
        )
    return required[0]
