"""The seams hold: no import circle, no import from a lower layer up, `import agentloop` loads no task,
short functions, and every engine behind one contract (a new one plugs in by name)."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_class

from agentloop.server.engine import ENGINES, Engine, build_engine
from agentloop.settings import rollout_settings
from tests.support.config import small_config

REPO = Path(__file__).resolve().parent.parent

# Top layer first; a module imports only from its own layer or the ones below it.
LAYERS = [
    ["trainer", "agentloop.tasks", "agentloop.viewer"],
    ["agentloop", "agentloop.config", "agentloop.testing"],
    ["agentloop.manager"],
    [
        "agentloop.worker",
        "agentloop.worker_pool",
        "agentloop.streaming",
        "agentloop.metrics",
        "agentloop.dumps",
        "agentloop.registry",
        "agentloop.postprocess",
        "agentloop.server_pool",
        "agentloop.preflight",
        "agentloop.judge",
        "agentloop.judge.pool",
    ],
    # the session gateway serves the loops' trajectories over HTTP; the loop that uses it (external_agent) is handed
    # its worker's, and imports nothing of it
    ["agentloop.gateway"],
    ["agentloop.agent_loop", "agentloop.judge.client", "agentloop.judge.front"],
    ["agentloop.router"],
    ["agentloop.server", "agentloop.judge.reward_model_server"],
    [
        "agentloop.tools",
        "agentloop.interactions",
        "agentloop.envs",
        "agentloop.rewards",
        "agentloop.reward_score",
        "agentloop.models",
        "agentloop.judge.session",
    ],
    [
        "agentloop.protocol",
        "agentloop.turn_totals",
        "agentloop.policy_versions",
        "agentloop.batch",
        "agentloop.rows",
        "agentloop.waiting",
        "agentloop.yaml_entries",
        "agentloop.config_keys",
        "agentloop.preparation",
        "agentloop.images",
        "agentloop.allocator",
        "agentloop.http_server",
        "agentloop.cluster",
        "agentloop.utils",
        "agentloop.settings",
    ],
]


def module_files() -> dict[str, Path]:
    files = {}
    for package in ("agentloop", "trainer"):
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (lazy imports inside functions included)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets |= {
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module
                    for alias in node.names
                }
        graph[module] = {target for target in targets if target in files and target != module}
    return graph


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, layer in enumerate(LAYERS)
        for prefix in layer
        if module == prefix or (prefix != "agentloop" and module.startswith(prefix + "."))
    ]
    assert matches, f"{module} is in no layer of LAYERS: add it where it belongs"
    return max(matches)[1]


def test_no_import_runs_up_a_layer():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in targets
        if layer_of(target) < layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    graph, state, cycles = import_graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(
                    " -> ".join(path[path.index(target) :] + [module, target])
                    if target in path
                    else f"{module} -> {target}"
                )
            elif target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def printed_by_fresh_python(code: str) -> str:
    """What ``code`` prints in a new interpreter: imports made by earlier tests do not count."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_importing_agentloop_loads_no_task_and_no_model_builder():
    code = "import sys, agentloop; print(sorted(m for m in sys.modules if m.startswith(('agentloop.tasks', 'agentloop.models.')) and m != 'agentloop.models.loading'))"
    assert printed_by_fresh_python(code) == "[]"


def test_the_viewer_starts_without_the_training_stack():
    # browsing dumps needs none of them: importing torch, tensordict and transformers cost its command ~3 CPU-seconds
    code = "import sys, agentloop.viewer.__main__; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'tensordict', 'transformers', 'ray'}))"
    assert printed_by_fresh_python(code) == "[]"


MAX_FUNCTION_LINES = 60


def test_functions_stay_short():
    """A function a reader takes in at once: at most 60 lines from ``def`` to its end, nested functions included."""
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)"
        for path in module_files().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, f"split these functions (over {MAX_FUNCTION_LINES} lines) into named steps:\n" + "\n".join(long)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_implements_the_contract(name):
    cls = get_class(ENGINES[name])
    assert isinstance(inspect.getattr_static(cls, "from_settings"), classmethod)
    for member, declared in vars(Engine).items():
        if inspect.iscoroutinefunction(declared):
            assert inspect.iscoroutinefunction(getattr(cls, member, None)), (
                f"{cls.__name__}.{member} must be `async def`"
            )
            declared_params = list(inspect.signature(declared).parameters)
            assert list(inspect.signature(getattr(cls, member)).parameters)[: len(declared_params)] == declared_params
        elif isinstance(declared, property):
            assert isinstance(inspect.getattr_static(cls, member, None), property), (
                f"{cls.__name__}.{member} must be a property"
            )


def test_unknown_backend_names_the_available_ones():
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref.rollout.name='trtllm': is not a known backend; choose one of \['hf', 'sglang', 'vllm'\]",
    ):
        rollout_settings(small_config("actor_rollout_ref.rollout.name=trtllm"))
    with pytest.raises(ValueError, match="'no_such.Engine' cannot be imported"):
        build_engine(rollout_settings(small_config("actor_rollout_ref.rollout.name=no_such.Engine")).servers, 0)


SECTIONS = {
    "actor_rollout_ref",
    "reward_model",
    "data",
    "algorithm",
    "trainer",
    "critic",
    "custom_reward_function",
    "async_training",
    "ray_kwargs",
}
# modules that read the composed config's sections: the edges, which build each part's settings (agentloop.settings)
# or check the job across sections, and verl's agent-loop contract, which hands loops the whole config
READS_SECTIONS = {
    "agentloop/settings/__init__.py": {"actor_rollout_ref"},  # builds the rollout side's settings
    "agentloop/manager.py": {"actor_rollout_ref", "custom_reward_function"},  # the rollout side's edge: file paths
    "agentloop/preflight.py": {"actor_rollout_ref", "reward_model"},  # the job's rows against its sections
    "agentloop/agent_loop/base.py": {"actor_rollout_ref", "data"},  # verl's AgentLoopBase: config, dataset_config
    "agentloop/worker.py": {"data"},  # verl's dataset_config for the loops
    "trainer/main_ppo.py": {"trainer"},  # the command
    "trainer/config_checks.py": {"actor_rollout_ref", "algorithm", "critic", "data", "trainer"},
    "trainer/ray_trainer.py": {"actor_rollout_ref", "data", "trainer"},
    # builds the trainer's parts' settings (ranks, rollout correction, dynamic sampling, overlong, async)
    "trainer/settings.py": {
        "actor_rollout_ref",
        "algorithm",
        "async_training",
        "critic",
        "data",
        "reward_model",
        "trainer",
    },
}


def sections_read() -> dict[str, set[str]]:
    """module path -> the top-level config sections it reads as ``<...>config.<section>``."""

    def name(node: ast.AST) -> str:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""

    found: dict[str, set[str]] = {}
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in SECTIONS and name(node.value).endswith("config"):
                found.setdefault(str(path.relative_to(REPO)), set()).add(node.attr)
    return found


def test_components_read_their_own_settings_not_the_whole_config():
    """Below the edges, a component gets its own section's settings (agentloop.settings), never the composed config
    to read another section's keys from (the edges, which build the settings, are listed in READS_SECTIONS)."""
    allowed = READS_SECTIONS
    found = sections_read()
    new = {module: sections - allowed.get(module, set()) for module, sections in found.items()}
    assert not {module: sections for module, sections in new.items() if sections}, (
        "these modules read config sections of the composed config: give them settings of their own "
        f"(agentloop.settings) instead: {new}"
    )
    stale = {module: sections - found.get(module, set()) for module, sections in allowed.items()}
    assert not {module: sections for module, sections in stale.items() if sections}, (
        f"no longer read, take them off the lists: {stale}"
    )
