"""``SandboxLimits``: every limit of a ``python_exec`` run, read from the tool YAML's ``config``."""

from __future__ import annotations

import math
import os
import pwd
from dataclasses import dataclass, fields
from typing import Any

# keys of the same mapping that the ToolSet reads, not the sandbox
TOOLSET_KEYS = {"timeout_s", "max_concurrency", "type"}


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run; each is named as in the YAML. How each is enforced: docs/guides/tools.md, "Sandboxed
    Python"."""

    wall_time_s: float = (
        10.0  # host timer: SIGTERM to the sandbox (its init dies, and its pid namespace), then SIGKILL to its group
    )
    cpu_time_s: int = (
        5  # RLIMIT_CPU (whole seconds; a fraction rounds up): SIGXCPU at the limit, SIGKILL a second later
    )
    memory_mb: int = 1024  # RLIMIT_AS: address space; allocations beyond it raise MemoryError
    max_processes: int = 16  # RLIMIT_NPROC: processes and threads, counted per sandbox inside a user namespace
    max_output_bytes: int = 16384  # stdout + stderr kept for the model; the rest is counted and dropped
    max_file_mb: int = (
        16  # RLIMIT_FSIZE: writing a file past it raises OSError(EFBIG); also the size of the private /dev/shm
    )
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_sandboxes: int = 0  # sandboxes at once per tool instance; 0: max_concurrency, else the CPU count
    sandbox_user: str = "nobody"  # when the host runs as root, the program runs as this user (name or uid)
    os_isolation: bool = True  # namespaces, read-only mounts, uid drop; False leaves rlimits and the audit hook
    masked_dirs: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run", "~")  # empty inside the sandbox
    work_root: str | None = None  # where the per-run directories are made (default: the system temp dir)
    python: str | None = None  # the program's interpreter (default: the host's)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SandboxLimits:
        """The limits a tool ``config`` mapping sets; unknown keys are an error naming the known ones."""
        names = [field.name for field in fields(cls)]
        unknown = sorted(set(config) - set(names) - TOOLSET_KEYS)
        if unknown:
            raise ValueError(
                f"python_exec config: unknown keys {unknown}; known: {sorted(names) + sorted(TOOLSET_KEYS)}"
            )
        values = {name: config[name] for name in names if name in config}
        if "masked_dirs" in values:
            values["masked_dirs"] = tuple(values["masked_dirs"] or ())
        if not values.get("max_sandboxes"):
            values["max_sandboxes"] = int(config.get("max_concurrency") or os.cpu_count() or 1)
        if "cpu_time_s" in values:
            values["cpu_time_s"] = math.ceil(values["cpu_time_s"])
        user = str(values.get("sandbox_user", cls.sandbox_user))
        if os.geteuid() == 0 and user and not user.isdigit():
            try:
                pwd.getpwnam(user)
            except KeyError:
                raise ValueError(f"python_exec config: sandbox_user {user!r} is not a user of this machine") from None
        limits = cls(**values)
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_mb",
            "max_processes",
            "max_output_bytes",
            "max_file_mb",
            "max_open_files",
            "max_sandboxes",
        ):
            if not getattr(limits, name) > 0:
                raise ValueError(f"python_exec config: {name} must be positive, got {getattr(limits, name)!r}")
        return limits
