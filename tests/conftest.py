"""Shared fixtures: the test models (built once per session, before any test), and a local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.models.tiny_reward_model import tiny_reward_model_path
from agentloop.models.tiny_vlm import tiny_vlm_path
from tests.support.models import (
    ScriptedModel,
    build_coin_model,
    build_gsm8k_model,
    build_ok_model,
    build_scripted_model,
    corridor_warm_start,
)

REPO = Path(__file__).resolve().parent.parent
# fixture -> the model it needs, built before the first test by one bounded subprocess
MODEL_FIXTURES = {
    "model_path": "tiny",
    "scripted_model": "scripted",
    "ok_model": "ok",
    "coin_model": "coin",
    "vlm_path": "vlm",
    "corridor_model": "corridor",
    "reward_model_path": "reward_model",
    "gsm8k_model": "gsm8k",
}
BUILD_TIMEOUT_S = float(os.environ.get("AGENTLOOP_TEST_BUILD_TIMEOUT_S", 1800))
# Every Ray instance the tests and the jobs they start make is their own: ray.init() would otherwise join one that
# other work on this machine started (a second suite, a training run), and fail or disturb it. A test that
# means to join one (the trainer runs of the async tests) names its address.
os.environ["RAY_ADDRESS"] = "local"
RAY_USERS: set[str] = set()  # the collected modules (paths) some test of which asks for local_ray


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the models the collected tests need, outside every test's timeout but bounded on its own."""
    needed = {
        MODEL_FIXTURES[name]
        for item in session.items
        for name in getattr(item, "fixturenames", ())
        if name in MODEL_FIXTURES
    }
    if not needed:
        return
    names = ["tiny", *sorted(needed - {"tiny"})]  # the others are fine-tuned from the tiny model
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    start = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tests.support.models", *names],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise pytest.UsageError(
            f"building the test models {names} took over {BUILD_TIMEOUT_S:.0f}s "
            "(raise AGENTLOOP_TEST_BUILD_TIMEOUT_S on a slow or busy machine)"
        ) from None
    if result.returncode:
        raise pytest.UsageError(f"building the test models {names} failed:\n{result.stderr[-3000:]}")
    if reporter is not None:
        reporter.write_line(
            f"test models {names} ready in {time.monotonic() - start:.0f}s (cached after the first build)"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that ask for ``local_ray`` run after the others and one after another, each module's tests
    in their own order: every switch between the two kinds would cost a start of the instance and a shutdown."""
    RAY_USERS.update(_module(item) for item in items if "local_ray" in getattr(item, "fixturenames", ()))
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(_module(item), index)
    items.sort(key=lambda item: (_module(item) in RAY_USERS, first[_module(item)]))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="session")
def model_path() -> str:
    return tiny_model_path()


@pytest.fixture(scope="session")
def scripted_model() -> ScriptedModel:
    return build_scripted_model()


@pytest.fixture(scope="session")
def ok_model() -> str:
    return build_ok_model()


@pytest.fixture(scope="session")
def coin_model() -> str:
    return build_coin_model()


@pytest.fixture(scope="session")
def gsm8k_model() -> str:
    """A model that plays verl's GSM8K example (``tests.support.models.build_gsm8k_model``)."""
    return build_gsm8k_model()


@pytest.fixture(scope="session")
def corridor_model() -> str:
    """The corridor task's warm start (``agentloop.tasks.corridor.warm_start``), as its config loads it."""
    return corridor_warm_start()


@pytest.fixture(scope="session")
def reward_model_path() -> str:
    """The tiny sequence-classification reward model (``agentloop.models.tiny_reward_model``)."""
    return tiny_reward_model_path()


@pytest.fixture(scope="session")
def vlm_path() -> str:
    """The tiny vision-language model (Qwen2-VL architecture, random weights)."""
    return tiny_vlm_path()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance (logical CPUs so two servers fit on two cores), shared by the modules that ask for
    it (they run one after another, see ``pytest_collection_modifyitems``) as long as each gives back every
    resource it took: a module that leaves an actor behind hands the next one a fresh instance."""
    if not ray.is_initialized():
        _init_local_ray()
    yield
    if not ray.is_initialized():
        return
    deadline = time.monotonic() + 10  # killed actors give their resources back asynchronously
    while _resources_held() and time.monotonic() < deadline:
        time.sleep(0.2)
    if _resources_held():
        ray.shutdown()


@pytest.fixture(autouse=True)
def ray_only_where_asked(request):
    """A test of a module that never asks for ``local_ray`` runs without the shared instance: its processes
    would count as the test's own (the sandbox checks them), and its idle workers would compete with a job
    the test starts in a subprocess. The other tests of a module that asks keep it, so that those before its
    first that asks cost no restart."""
    if _module(request.node) not in RAY_USERS and ray.is_initialized():
        ray.shutdown()


def _init_local_ray() -> None:
    """Start the local instance with the repository on its workers' path (they import ``tests.support``).

    The path reaches them through the environment the instance's processes inherit, not a job-level
    ``runtime_env``: the workers Ray starts ahead of demand have none, so with one every actor would wait
    for a process of its own to start (a second or two each, for the hundreds of actors the suite starts)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _resources_held() -> dict[str, float]:
    """Resources (memory and the object store aside) some actor or task still holds."""
    available = ray.available_resources()
    return {
        key: total - available.get(key, 0.0)
        for key, total in ray.cluster_resources().items()
        if "memory" not in key and available.get(key, 0.0) < total
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with pytest's own status once every report is written: native threads that tests leave behind (Ray's
    core worker, torch's pools, transformers' batching threads) have crashed interpreter teardown with SIGSEGV
    after all tests passed, which would turn a green run red."""
    if _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])


_EXIT_STATUS = pytest.StashKey[int]()
