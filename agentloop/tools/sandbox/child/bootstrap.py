"""The sandbox's first processes, started by the host as ``python -I -c <launcher> <config json>``.

Standard library only (run inside the sandbox, never imported by the host). Three processes:

- **P** (this entry point) enters new mount, network and pid namespaces where the OS allows, forks
  the init and waits; on SIGTERM (the host's wall timer) it kills the init, which takes the whole
  pid namespace with it.
- **init** (pid 1 of the new pid namespace) mounts a private /proc, masks the temp dirs and the
  home directory, remounts everything read-only except the working directory, drops to the
  sandbox user, reports the active layers, forks the program, reaps and reports its end.
- **program**: sets the rlimits, closes the status pipe and execs ``python -I -B -u -c guard.py``.

Status lines (JSON) go to the pipe the host passed: ``{"layers": ...}``, then ``{"exit_code": n}``
or ``{"signal": n}`` with ``cpu_s``, or ``{"setup_error": text}``.
"""

import json
import os
import resource
import signal
import sys

import namespaces

HERE = os.path.dirname(os.path.abspath(__file__))


def report(status_fd: int, **fields) -> None:
    os.write(status_fd, (json.dumps(fields) + "\n").encode())


def interpreter_paths() -> "list[str]":
    """What the program's interpreter needs to start and import: its prefixes and its binary's directory."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}
    paths |= {os.path.realpath(path) for path in list(paths)} | {os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(path for path in paths if path and os.path.exists(path))


def outermost(paths: "list[str]") -> "list[str]":
    """``paths`` without those inside another one of them, shortest first."""
    kept: "list[str]" = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if not any(path == other or path.startswith(other.rstrip("/") + "/") for other in kept):
            kept.append(path)
    return kept


def isolate_filesystem(config: dict, drop_uid: bool) -> str:
    """In the new mount namespace: a private /proc, the masks, then everything read-only but the
    workdir. Returns what holds; raises ``OSError`` only if mounts could not be made private (then
    nothing was changed)."""
    workdir, notes = config["workdir"], []
    namespaces.make_mounts_private()
    try:
        namespaces.mount_proc()
    except OSError as error:
        notes.append(f"host /proc visible ({error.strerror})")
    keep = outermost(interpreter_paths() + [workdir])
    masks = [path for path in config["masked_dirs"] if os.path.isdir(path) and path != "/"]
    if drop_uid:  # e.g. an interpreter under /root (0700): the sandbox user could not even start it
        masks += [ancestor for path in keep for ancestor in namespaces.unreachable_ancestors(path)]
    writable = {config["shm_dir"]} & set(masks)
    masked = []
    for directory in outermost(masks):
        try:
            namespaces.mask(directory, keep, config["limits"]["file_mb"] if directory in writable else None)
            masked.append(directory)
        except OSError as error:
            notes.append(f"{directory} not masked ({error.strerror})")
    try:
        namespaces.bind_in_place(workdir)
    except OSError as error:  # without its own mount the workdir would turn read-only with the rest
        return ", ".join([f"writable mounts ({error.strerror})", *notes])
    refused = namespaces.remount_read_only({workdir} | writable)
    if refused:
        notes.append(f"left writable: {refused}")
    return ", ".join(["read-only mounts", f"masked {masked}", *notes])


def can_start_as(uid: int, gid: int, config: dict) -> bool:
    """Whether ``uid`` can run the interpreter and write the workdir (checked in a throwaway child)."""
    paths = interpreter_paths()  # listed while we can still see them all
    child = os.fork()
    if child == 0:
        ok = False
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            ok = all(os.access(path, os.R_OK | os.X_OK) for path in paths)
            ok = ok and os.access(config["workdir"], os.W_OK | os.X_OK)
        finally:
            os._exit(0 if ok else 1)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0


def isolate(config: dict, ns_kind: "str | None") -> "dict[str, str]":
    """Every layer this OS allows, in the init; returns what is active, by concern."""
    uid, gid = config.get("uid"), config.get("gid")
    drop_uid = os.geteuid() == 0 and uid is not None
    layers = {
        "namespaces": ns_kind or ("none (unshare refused)" if config["os_isolation"] else "none (os_isolation: false)")
    }
    if ns_kind:
        try:
            layers["files"] = isolate_filesystem(config, drop_uid)
        except OSError as error:
            layers["files"] = f"audit hook only ({error.strerror})"
        layers["network"] = "network namespace (no interfaces)"
        layers["cleanup"] = "pid namespace (its processes die with its init)"
    else:
        layers["files"] = "audit hook only"
        layers["network"] = "audit hook only"
        layers["cleanup"] = "process group (a program that calls setsid escapes it)"
    kept_root = ""
    if drop_uid and not can_start_as(uid, gid, config):
        drop_uid, kept_root = False, f" (uid {uid} cannot start the interpreter or write the workdir)"
    if drop_uid:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if layers["files"].startswith("audit hook only"):
            layers["files"] += (
                f"; the OS refuses writes uid {uid} has no permission for (/tmp stays open to a program that evades the hook)"
            )
    layers["user"] = f"uid {os.getuid()}" + (" (dropped from root)" if drop_uid else kept_root)
    if os.geteuid() == 0:
        layers["processes"] = "audit hook refuses fork (root ignores RLIMIT_NPROC)"
        return layers
    try:  # RLIMIT_NPROC then counts this sandbox's processes only; for ns_kind "user" it also locks the mounts
        if ns_kind == "user":
            namespaces.lock_mounts()
        else:
            namespaces.unshare(namespaces.CLONE_NEWUSER)
        layers["processes"] = "RLIMIT_NPROC, counted per sandbox (user namespace)"
    except OSError:
        layers["processes"] = f"RLIMIT_NPROC, counted over every process of uid {os.getuid()}"
        if ns_kind == "user":
            layers["files"] += " (not locked: nested user namespace refused)"
    return layers


def set_limits(limits: dict) -> None:
    """The program's rlimits (lowering a hard limit needs no privilege; raising it back does)."""
    mb = 1024 * 1024
    cpu = limits["cpu_s"]
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        ("RLIMIT_AS", limits["memory_mb"] * mb, limits["memory_mb"] * mb),
        ("RLIMIT_NPROC", limits["processes"], limits["processes"]),
        ("RLIMIT_FSIZE", limits["file_mb"] * mb, limits["file_mb"] * mb),
        ("RLIMIT_NOFILE", limits["open_files"], limits["open_files"]),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def run_program(config: dict, layers: "dict[str, str]") -> None:
    """In the forked program process: limits, then exec the guarded interpreter. Never returns."""
    try:
        os.close(config["status_fd"])
        os.chdir(config["workdir"])
        set_limits(config["limits"])
        guard_config = {"workdir": config["workdir"], "refuse_fork": layers["processes"].startswith("audit hook")}
        argv = [sys.executable, "-I", "-B", "-u", "-c", config["guard_source"], json.dumps(guard_config)]
        os.execve(sys.executable, argv, config["env"])
    except BaseException as error:  # nothing above this frame may run: report and exit
        os.write(2, f"python_exec: could not start the program: {error}\n".encode())
    os._exit(127)


def init(config: dict, ns_kind: "str | None") -> None:
    """The pid namespace's init: isolate, fork the program, reap every child, report. Never returns."""
    status_fd = config["status_fd"]
    try:
        layers = isolate(config, ns_kind)
    except Exception as error:  # reported to the host, which raises it
        report(status_fd, setup_error=f"{type(error).__name__}: {error}")
        os._exit(1)
    report(status_fd, layers=layers)
    program = os.fork()
    if program == 0:
        run_program(config, layers)
    while True:  # as pid 1, orphans of the program are ours to reap too
        pid, wait_status, usage = os.wait4(-1, 0)
        if pid == program:
            break
    cpu_s = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(wait_status):
        report(status_fd, signal=os.WTERMSIG(wait_status), cpu_s=cpu_s)
    else:
        report(status_fd, exit_code=os.WEXITSTATUS(wait_status), cpu_s=cpu_s)
    os._exit(0)


def main() -> None:
    config = json.loads(sys.argv[1])
    # read now: once the uid is dropped and the mounts masked, this file may be out of reach
    with open(os.path.join(HERE, "guard.py")) as file:
        config["guard_source"] = file.read()
    privileged = os.geteuid() == 0
    ns_kind = namespaces.enter_namespaces(privileged) if config["os_isolation"] else None
    child = os.fork()
    if child == 0:
        init(config, ns_kind)

    def stop(*_) -> None:  # the host's wall timer: killing the init ends its whole pid namespace
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    _, wait_status = os.waitpid(child, 0)
    if os.WIFSIGNALED(wait_status):
        report(config["status_fd"], init_signal=os.WTERMSIG(wait_status))


if __name__ == "__main__":
    main()
