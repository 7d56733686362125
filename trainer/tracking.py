"""Where step metrics go: a JSONL file always, plus the backends named in ``trainer.logger``.

``console`` prints one line per step, ``tensorboard`` writes event files (``pip install -e ".[tensorboard]"``),
``wandb`` logs a run (``pip install -e ".[wandb]"``). At the end, ``plot`` draws reward and response length
over steps to a PNG, and ``summarize`` prints how far the reward moved.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any, Callable

import numpy as np
from omegaconf import DictConfig, OmegaConf

from trainer.settings import RunSettings


class Tracking:
    """Fan out each step's metrics; ``resume_step`` drops JSONL lines a killed run logged after its last checkpoint."""

    def __init__(
        self,
        run: RunSettings,
        directory: Path,
        print_line: Callable[[str], None] = print,
        resume_step: int = 0,
        run_config: DictConfig | None = None,
    ) -> None:
        """``run_config``: the composed config, recorded whole with a wandb run (only ``run`` is read)."""
        loggers = run.logger
        self.print_line = print_line if "console" in loggers else None
        self.path = directory / "metrics.jsonl"
        kept = [line for line in _read_jsonl(self.path) if line.get("step", 0) <= resume_step] if resume_step else []
        self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        self.history: list[dict[str, Any]] = kept
        self.tensorboard = self.wandb = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    "trainer.logger has tensorboard but it is not installed: pip install tensorboard"
                ) from error
            self.tensorboard = SummaryWriter(str(directory / "tensorboard"))
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError as error:
                raise ImportError("trainer.logger has wandb but it is not installed: pip install wandb") from error
            # a resumed run continues the same wandb run: its id is kept beside the checkpoints
            id_file = directory / "wandb_run_id"
            run_id = id_file.read_text().strip() if resume_step and id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self.wandb = wandb.init(
                project=run.project_name,
                name=run.experiment_name,
                id=run_id,
                resume="allow",
                dir=str(directory),
                config=OmegaConf.to_container(run_config, resolve=True) if run_config is not None else {},
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's metrics everywhere; nested values are flattened (``{"a": [1, 2]}``: ``a/0``, ``a/1``)."""
        metrics = flatten(metrics)
        line = {"step": step, **metrics}
        self.history.append(line)
        with open(self.path, "a") as file:
            file.write(json.dumps(line) + "\n")
        if self.print_line:
            self.print_line(
                " ".join(
                    f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                    for key, value in line.items()
                )
            )
        if self.tensorboard:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float | int]:
    """Numbers only, one level: dicts and lists become ``key/sub`` entries; anything else is dropped."""
    flat: dict[str, float | int] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            flat.update(flatten(dict(enumerate(value)), f"{name}/"))
        elif isinstance(value, (bool, int, float, np.number)):
            flat[name] = value.item() if isinstance(value, np.number) else value
    return flat


def plot(
    history: list[dict[str, Any]], path: Path, keys: tuple[str, ...] = ("critic/score/mean", "response_length/mean")
) -> Path:
    """Draw each of ``keys`` over steps (one panel each; validation scores join the reward panel) and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for axis, key in zip(axes[0], keys):
        points = [(line["step"], line[key]) for line in history if key in line]
        axis.plot([s for s, _ in points], [v for _, v in points], marker=".", label=key)
        if key == keys[0]:
            val = [(line["step"], line["val/score/mean"]) for line in history if "val/score/mean" in line]
            if val:
                axis.plot([s for s, _ in val], [v for _, v in val], marker="o", label="val/score/mean")
        axis.set_xlabel("step")
        axis.set_title(key)
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(history: list[dict[str, Any]], png: Path) -> None:
    """Print how far the mean reward moved: the starting policy's (step 1 rollouts) against the last steps'."""
    scores = [line["critic/score/mean"] for line in history if "critic/score/mean" in line]
    if scores:
        window = min(5, len(scores))
        last = float(np.mean(scores[-window:]))
        print(
            f"mean reward: {scores[0]:.3f} at step 1 -> {last:.3f} over the last {window} steps ({last - scores[0]:+.3f})"
        )
    validation = [line["val/score/mean"] for line in history if "val/score/mean" in line]
    if len(validation) > 1:
        print(f"validation score: {validation[0]:.3f} -> {validation[-1]:.3f}")
    print(f"curves: {png}")
