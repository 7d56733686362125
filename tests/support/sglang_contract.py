"""SGLang's own JSON contract for /generate, loaded from the installed wheel (``pip install --no-deps sglang``).

Only ``sglang/api/v1/api_types.py`` is loaded (by path, needing only msgspec): importing the sglang
package would pull its GPU dependencies.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_api_types() -> ModuleType | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "api" / "v1" / "api_types.py"
    if not path.exists() or importlib.util.find_spec("msgspec") is None:
        return None
    module_spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def wheel_file(relative: str) -> Path | None:
    """A file of the installed sglang wheel (None without the wheel), read as text, never imported."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    return path if path.exists() else None


def route_request_fields(route: str) -> tuple[set[str], set[str]]:
    """The JSON fields of the request class SGLang's HTTP server reads at ``route``: (required, optional).

    Read from the wheel's source (``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``): importing
    them needs SGLang's GPU dependencies."""
    server = ast.parse(wheel_file("srt/entrypoints/http_server.py").read_text())
    handler = next(
        node
        for node in ast.walk(server)
        if isinstance(node, ast.AsyncFunctionDef)
        and any(
            isinstance(decorator, ast.Call)
            and decorator.args
            and isinstance(decorator.args[0], ast.Constant)
            and decorator.args[0].value == route
            for decorator in node.decorator_list
        )
    )
    # the body parameter: ``obj: Annotated[<RequestClass>, Body()]``
    annotation = handler.args.args[0].annotation
    class_name = annotation.slice.elts[0].id
    classes = {
        node.name: node
        for node in ast.parse(wheel_file("srt/managers/io_struct.py").read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    required, optional = set(), set()
    pending = [class_name]
    while pending:
        node = classes.get(pending.pop())
        if node is None:
            continue
        pending += [base.id for base in node.bases if isinstance(base, ast.Name)]
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                (optional if statement.value is not None else required).add(statement.target.id)
    return required, optional


LORA_PARSER = """
import argparse, ast, importlib.util, json, sys, types
root = sys.argv[1]

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

# the two stdlib-only modules the LoRA fields use, and the constants they read from sglang.srt.utils.common
load("sglang.srt.arg_groups.arg_utils", root + "/srt/arg_groups/arg_utils.py")
load("sglang.srt.arg_groups.argparse_actions", root + "/srt/arg_groups/argparse_actions.py")
common = types.ModuleType("sglang.srt.utils.common")
for node in ast.parse(open(root + "/srt/utils/common.py").read()).body:
    names = [target.id for target in getattr(node, "targets", []) if isinstance(target, ast.Name)]
    if names and names[0] in ("SUPPORTED_LORA_TARGET_MODULES", "LORA_TARGET_ALL_MODULES"):
        setattr(common, node.targets[0].id, ast.literal_eval(node.value))
sys.modules["sglang.srt.utils.common"] = common
registry = types.ModuleType("sglang.srt.lora.lora_registry")
registry.LoRARef = type("LoRARef", (), {})  # only named in --lora-paths' type
sys.modules["sglang.srt.lora.lora_registry"] = registry
fields = load("sglang_lora_fields", root + "/srt/arg_groups/fields/lora.py")
parser = argparse.ArgumentParser()
sys.modules["sglang.srt.arg_groups.arg_utils"].add_cli_args_from_dataclass(parser, fields.Lora)
namespace = parser.parse_args(json.loads(sys.argv[2]))
print(json.dumps({key: sorted(value) if isinstance(value, (set, list)) else value for key, value in vars(namespace).items() if key != "lora_paths"}))
"""


def parse_lora_flags(flags: list[str]) -> dict[str, Any]:
    """``flags`` parsed by the installed wheel's own parser of its LoRA server arguments (``srt/arg_groups``'s
    ``add_cli_args_from_dataclass`` over ``fields/lora.py``'s ``Lora``), in a child process: the wheel's modules
    are loaded by path there, beside stand-ins for the two GPU-bound modules they import names from. An unknown
    flag, a bad value or a module SGLang cannot adapt fails as ``launch_server`` would."""
    root = str(wheel_file(".") or "")
    completed = subprocess.run(
        [sys.executable, "-c", LORA_PARSER, root, json.dumps(flags)], capture_output=True, text=True, timeout=120
    )
    if completed.returncode:
        raise ValueError(f"SGLang's parser refused {flags}: {completed.stderr[-2000:]}")
    return json.loads(completed.stdout)


SGLANG_GROUP_MEMBER = """
import ast, json, sys
import torch
import torch.distributed as dist
common, address, port, world_size, rank, group_name, slots, out = sys.argv[1:]
# SGLang's own init_custom_process_group, from the wheel's source (its module needs SGLang's GPU dependencies)
tree = ast.parse(open(common).read())
function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "init_custom_process_group")
namespace = {"torch_release": tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])}
exec(compile(ast.Module([function], []), common, "exec"), namespace)
# SGLang's scheduler has its default group before it joins a weight group (weight_updater asserts so)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = namespace["init_custom_process_group"](
    backend="gloo", init_method=f"tcp://{address}:{port}", world_size=int(world_size), rank=int(rank),
    group_name=group_name,
)
received = {}
for name, dtype, shape in json.loads(slots):  # as weight_updater.receive_weights_from_distributed does
    received[name] = torch.empty(shape, dtype=getattr(torch, dtype))
    dist.broadcast(received[name], src=0, group=group)
torch.save(received, out)
"""


def run_sglang_group_member(
    address: str, port: int, world_size: int, rank: int, group_name: str, slots: list, out: str
) -> subprocess.Popen:
    """A process that joins the weight group ``group_name`` with the installed wheel's own
    ``init_custom_process_group`` (what ``/init_weights_update_group`` runs), receives one broadcast per
    ``(name, dtype, shape)`` of ``slots`` as its ``/update_weights_from_distributed`` does, and saves them to ``out``."""
    common = str(wheel_file("srt/utils/common.py"))
    arguments = [common, address, str(port), str(world_size), str(rank), group_name, json.dumps(slots), out]
    return subprocess.Popen([sys.executable, "-c", SGLANG_GROUP_MEMBER, *arguments], stderr=subprocess.PIPE, text=True)
