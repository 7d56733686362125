"""Linux namespaces and mounts through libc (ctypes), for the sandbox's own processes.

Standard library only: ``bootstrap`` imports this as a top-level module inside the sandbox; the host
never runs it. Every call either works or raises ``OSError``; the caller decides what a failure means.
"""

import ctypes
import os
import stat

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

# statvfs flag -> mount flag: a remount must repeat these, or one inside a user namespace is refused
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _bytes(value: "str | None") -> "bytes | None":
    return None if value is None else os.fsencode(value)


def unshare(flags: int) -> None:
    """Move this process into new namespaces (a new pid namespace applies to its children only)."""
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source: "str | None", target: str, fstype: "str | None", flags: int, data: "str | None" = None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def enter_namespaces(privileged: bool) -> "str | None":
    """New mount, network and pid namespaces for this process: ``"privileged"`` (root, no user
    namespace), ``"user"`` (inside a new user namespace mapping our own ids) or ``None`` when refused."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if privileged:
        try:
            unshare(flags)
            return "privileged"
        except OSError:
            return None  # root without CAP_SYS_ADMIN: keep it simple, no user-namespace variant for root
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(CLONE_NEWUSER | flags)
    except OSError:
        return None
    # our ids mapped to themselves, so that a nested user namespace can be made later (lock_mounts)
    with open("/proc/self/uid_map", "w") as file:
        file.write(f"{uid} {uid} 1")
    with open("/proc/self/setgroups", "w") as file:
        file.write("deny")
    with open("/proc/self/gid_map", "w") as file:
        file.write(f"{gid} {gid} 1")
    return "user"


def make_mounts_private() -> None:
    """Stop mount events from propagating to the host: every change after this stays in the sandbox."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def mount_proc() -> None:
    """A /proc of the sandbox's own pid namespace (called by its init): host processes become invisible."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def mask(directory: str, keep: "list[str]", writable_mb: "int | None" = None) -> None:
    """Cover ``directory`` with an empty tmpfs; the ``keep`` paths under it are bound back in place.

    The kept paths are opened (O_PATH) before the tmpfs hides them and bound from ``/proc/self/fd``.
    ``writable_mb`` leaves the tmpfs writable with that size (a private /dev/shm); otherwise the
    read-only remount that follows covers it too.
    """
    inside = [path for path in keep if path.startswith(directory.rstrip("/") + "/")]
    handles = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in inside]
    try:
        size = f"size={writable_mb}m" if writable_mb else "size=1m"
        mount(
            "tmpfs",
            directory,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"mode=1777,{size}" if writable_mb else f"mode=0755,{size}",
        )
        for path, handle in handles:
            if stat.S_ISDIR(os.fstat(handle).st_mode):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "a").close()
            mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC)
    finally:
        for _, handle in handles:
            os.close(handle)


def bind_in_place(path: str) -> None:
    """Make ``path`` a mount of its own, so the read-only remount can leave it writable."""
    mount(path, path, None, MS_BIND | MS_REC)


def mount_points() -> "list[str]":
    """Mount points of this mount namespace, outermost first."""
    points = []
    with open("/proc/self/mountinfo") as file:
        for line in file:
            # field 5 is the mount point, with space, tab, newline and backslash octal-escaped
            points.append(line.split()[4].encode().decode("unicode_escape").encode("latin-1").decode())
    return points


def remount_read_only(skip: "set[str]") -> "list[str]":
    """Every mount read-only except those at ``skip``; returns the mount points that refused."""
    refused = []
    for point in mount_points():
        if point in skip:
            continue
        try:
            current = os.statvfs(point).f_flag
        except OSError:
            continue  # hidden under a mask: unreachable anyway
        kept = sum(flag for st_flag, flag in _KEPT_FLAGS if current & st_flag)
        try:
            mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | kept)
        except OSError:
            refused.append(point)
    return refused


def lock_mounts() -> None:
    """A nested user and mount namespace: the mounts become locked (no remount read-write, no
    unmount revealing what is below) and this process keeps no capability over them."""
    unshare(CLONE_NEWUSER | CLONE_NEWNS)


def unreachable_ancestors(path: str) -> "list[str]":
    """The directories above ``path`` that other users cannot enter (no o+x), outermost first."""
    found, current = [], "/"
    for part in [part for part in path.split("/") if part][:-1]:
        current = os.path.join(current, part)
        try:
            if not os.stat(current).st_mode & stat.S_IXOTH:
                found.append(current)
        except OSError:
            break
    return found
