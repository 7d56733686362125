"""The documentation against the code: every metric name the code logs is on the metrics page, and the generated
configuration reference has every key of ``config/ppo_trainer.yaml`` with its default."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
METRICS_PAGE = REPO / "docs" / "reference" / "metrics.md"
# the first part of every logged name (verl's namespaces and agentloop's own)
NAMESPACES = (
    "actor|critic|rollout|rollout_corr|multi_turn|num_turns|tool_call_counts|timing_s|judge|supervision|async"
    "|dynamic_sampling|overlong|perf|training|val|response_length|prompt_length"
)
METRIC_NAME = re.compile(rf"^(?:{NAMESPACES})/[\w{{}}/<>-]*$")


def documented_names() -> list[str]:
    """The names in the first column of the metrics page's tables, as written there."""
    lines = [line for line in METRICS_PAGE.read_text().splitlines() if line.startswith("| `")]
    return [name for line in lines for name in re.findall(r"`([^`]+)`", line.split(" | ")[0])]


def documented_patterns() -> list[re.Pattern]:
    """The documented names as patterns: ``<x>`` matches one part (``<data_source>`` any text: ``openai/gsm8k``),
    ``{a,b}`` either."""
    patterns = []
    for name in documented_names():
        regex = re.escape(name).replace(r"\<", "<").replace(r"\>", ">")
        regex = regex.replace("<data_source>", ".+")
        regex = re.sub(r"<[^>]+>", "[^/]+", regex)
        regex = re.sub(r"\\\{([^}]+)\\\}", lambda m: "(" + m[1].replace(",", "|") + ")", regex)
        patterns.append(re.compile(regex + "$"))
    return patterns


def undocumented(names) -> list[str]:
    """The metric names (a step's logged keys) that no row of the metrics page covers."""
    patterns, written = documented_patterns(), documented_names()

    def covered(name: str) -> bool:
        if "X" in name.split("/"):  # an f-string's parts made at run time: some documented name must fit it
            fits = re.compile("/".join(".+" if part == "X" else re.escape(part) for part in name.split("/")) + "$")
            return any(fits.match(other) for other in written)
        return any(p.match(name) or p.match(name + "/mean") or p.match(name + "/0") for p in patterns)

    return sorted(name for name in set(names) if not covered(name))


def names_in_code() -> set[str]:
    """Metric names written out in agentloop/ and trainer/: string literals in a metric namespace, and f-strings
    with each replaced part read as ``X``."""
    names = set()
    for path in [*(REPO / "agentloop").rglob("*.py"), *(REPO / "trainer").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        inside_fstrings = {
            id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values
        }
        for node in ast.walk(tree):
            if id(node) in inside_fstrings:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(part.value if isinstance(part, ast.Constant) else "X" for part in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if METRIC_NAME.match(text) and not text.endswith("/"):
                names.add(text)
    return names


def test_every_metric_name_in_the_code_is_documented():
    names = names_in_code()
    assert len(names) > 40, "the scan found the code's metric names"
    missing = undocumented(names)
    assert not missing, f"add these metric names to docs/reference/metrics.md: {missing}"


def test_the_metric_check_catches_a_missing_name():
    assert undocumented(["rollout/cached_token_share", "multi_turn/finish_reason/stop", "actor/pg_loss"]) == []
    assert undocumented(["rollout/no_such_metric", "async/staleness_histogram/3"]) == ["rollout/no_such_metric"]
    assert undocumented(["val/score/openai/gsm8k", "async/staleness_histogram/1/2"]) == [
        "async/staleness_histogram/1/2"
    ]
    assert undocumented(["multi_turn/interaction_score/turn_X", "timing_s/X", "no_such/X"]) == ["no_such/X"]


def reference_module():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "docs" / "hooks" / "config_reference.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(leaves(value, path + "."))
        else:
            out[path] = value
    return out


def test_the_config_reference_has_every_key_with_its_default():
    reference = reference_module()
    text = (REPO / "config" / "ppo_trainer.yaml").read_text()
    tree = yaml.safe_load(text)
    tree.pop("defaults")
    expected = leaves(tree)
    _, keys = reference.parse(text)
    parsed = {}
    for key in keys:
        value = None if key.section else yaml.safe_load(key.value)
        if not key.section:  # a flow mapping ({CPU: 1, GPU: 0}) is one key of the page, several of the tree
            parsed.update(leaves(value, key.path + ".") if isinstance(value, dict) and value else {key.path: value})
    assert parsed == expected
    page = reference.config_reference("reference")
    for key in keys:  # a key in a row with its default, a section in a heading or a row
        assert (
            f"| {reference.key_cell(key.path)} | {'(section)' if key.section else reference.code(key.value)} |" in page
            or (key.section and f"# `{key.path}`\n" in page)
        ), key.path
    assert "[guides/" in page or "[concepts/" in page, "docs/ mentions in the comments become links"


def test_the_ignored_keys_page_lists_verl_ignored_yaml():
    reference = reference_module()
    tree = yaml.safe_load((REPO / "config" / "verl_ignored.yaml").read_text())
    defined = set(leaves(yaml.safe_load((REPO / "config" / "ppo_trainer.yaml").read_text())))
    page = reference.ignored_keys("reference")
    for path in leaves(tree):
        if path not in defined and not any(path.startswith(d + ".") for d in defined):
            assert f"`{path.rsplit('.', 1)[0]}" in page, path


def test_the_quick_start_page_shows_the_readmes_two_commands():
    def commands(path: Path) -> str:
        return re.search(r"```bash\n(.*?)```", path.read_text(), re.S)[1]

    assert commands(REPO / "docs" / "getting-started" / "quick-start.md") == commands(REPO / "README.md")
