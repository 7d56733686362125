"""The lock and the declared ranges agree, and every install path uses the lock: a fresh machine gets the tested set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def locked() -> dict[str, Version]:
    pins = (
        re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)$", line.strip())
        for line in (REPO / "constraints.txt").read_text().splitlines()
    )
    return {canonicalize_name(pin[1]): Version(pin[2]) for pin in pins if pin}


def declared() -> list[Requirement]:
    return [
        Requirement(text)
        for text in [
            *PROJECT["dependencies"],
            *(r for extra in PROJECT["optional-dependencies"].values() for r in extra),
        ]
    ]


def test_the_lock_pins_every_declared_dependency_inside_its_range():
    pins = locked()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt has no pin for {requirement} (refresh it with .ci/lock)"
        assert requirement.specifier.contains(pins[name]), (
            f"constraints.txt pins {name}=={pins[name]}, outside {requirement}"
        )


def test_fast_moving_dependencies_have_an_upper_bound():
    bounded = {
        canonicalize_name(r.name)
        for r in declared()
        if any(spec.operator in ("<", "<=", "==", "~=") for spec in r.specifier)
    }
    assert {"torch", "transformers", "ray", "tensordict", "mcp", "sglang"} <= bounded


def test_the_readme_ci_and_docker_install_with_the_lock():
    readme = (REPO / "README.md").read_text()
    commands = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.S)[1].strip().splitlines()
    assert len(commands) == 2, "the quick start is exactly two commands"
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run runs the README's test command"
    for command in commands:
        assert "pip install -c constraints.txt -e " in command and "python -m " in command
    assert "-c constraints.txt" in (REPO / "docker" / "Dockerfile.cpu").read_text()
