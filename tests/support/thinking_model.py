"""A thinking model for the reasoning tests: the tiny model's tokenizer with Qwen3's real chat template, and a
replay engine that writes what Qwen3 writes after that template's generation prompt (``<think>\\n``).

The template comes from the shared fixture (``../shared/fixtures/qwen3``); our tiny tokenizer has the same
ChatML and think tokens, so the template's hazards are all there. Select the engine with
``actor_rollout_ref.rollout.name=tests.support.thinking_model.ThinkingReplayEngine``; a prompt picks its
turn by name with ``turn_prompt``.
"""

from __future__ import annotations

import json
from pathlib import Path


from tests.support.hostile_outputs import HostileOutput
from tests.support.replay_engine import ReplayEngine, fuzz_prompt
from agentloop.settings import ServerSettings

QWEN3_CONFIG = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "qwen3" / "tokenizer_config.json"
TOOLS_PATH = str(Path(__file__).with_name("thinking_tools.yaml"))
NON_ASCII_ARGUMENTS = {"text": "Grüße aus Zürich, 東京 👋", "times": 1}


def _hermes(name: str, arguments: dict) -> str:
    # written as a model writes JSON, characters unescaped (format_hermes escapes them)
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


# The turns start inside the reasoning the prompt opened: only the closing tag is the model's.
TURNS: dict[str, str] = {
    "call_while_reasoning": f"Maybe {_hermes('calculator', {'expression': '1 + 1'})} but no.\n</think>\n\nNo tool needed.",
    "call_after_reasoning": f"Add them.\n</think>\n\n{_hermes('calculator', {'expression': '2 + 3'})}",
    "cut_off_while_reasoning": f"Still thinking {_hermes('calculator', {'expression': '4 + 4'})} and",
    "non_ascii_arguments": f"Greet them.\n</think>\n\n{_hermes('echo', NON_ASCII_ARGUMENTS)}",
}


def turn_prompt(name: str) -> list[dict[str, str]]:
    """The chat prompt that makes ``ThinkingReplayEngine`` write turn ``name`` first."""
    return fuzz_prompt(list(TURNS).index(name))


def qwen3_template() -> str:
    return json.loads(QWEN3_CONFIG.read_text())["chat_template"]


def with_qwen3_template(model_path: str, directory: Path) -> str:
    """A model directory: the files of ``model_path`` (linked) with Qwen3's chat template in place of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in Path(model_path).iterdir():
        if file.name != "chat_template.jinja":
            (directory / file.name).symlink_to(file.resolve())
    (directory / "chat_template.jinja").write_text(qwen3_template())
    return str(directory)


class ThinkingReplayEngine(ReplayEngine):
    """Replays ``TURNS`` by prompt; a session's later turns close the reasoning the prompt opened and say ``Done.``"""

    last_turn = "\n</think>\n\nDone."

    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> ThinkingReplayEngine:
        cases = [HostileOutput("thinking", text, None) for text in TURNS.values()]
        return cls(settings.model_path, cases)
