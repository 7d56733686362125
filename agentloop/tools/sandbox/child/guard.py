"""Runs the model's program: ``python -I -B -u -c <this file> <config json>`` in the working directory.

Standard library only. Before ``main.py`` runs it installs an audit hook (PEP 578) that refuses
network calls, writes outside the working directory and starting other programs (and ``fork`` when
no process limit holds). The hook is a courtesy layer: it names the cause in plain words and covers
systems without namespaces, but a determined program evades it (``ctypes``, a C extension,
``os.open`` with ``dir_fd``); only the OS layers below it hold against that.

An uncaught exception ends the program with one of the ``EXIT_*`` codes below, which the host turns
into an error naming the limit (a program calling ``sys.exit`` with one of them is misreported).
The host imports this module for those codes; nothing runs on import.
"""

import builtins
import errno
import json
import os
import sys
import traceback

EXIT_MEMORY = 240
EXIT_PROCESSES = 241
EXIT_FILE_SIZE = 242
EXIT_REFUSED_NETWORK = 243
EXIT_REFUSED_WRITE = 244
EXIT_REFUSED_EXEC = 245
EXIT_REFUSED_FORK = 246

NETWORK_EVENTS = {
    "socket.bind",
    "socket.connect",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
}
EXEC_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.startfile"}
FORK_EVENTS = {"os.fork", "os.forkpty"}
# event -> (path argument, its dir_fd argument or None) for each path the event changes
PATH_EVENTS = {
    "os.mkdir": ((0, 2),),
    "os.rmdir": ((0, 1),),
    "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((1, 3),),
    "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "os.chflags": ((0, None),),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
WRITABLE_OUTSIDE = {"/dev/null", "/dev/stdout", "/dev/stderr"}


class SandboxRefusal(PermissionError):
    """An operation the sandbox refuses; ``exit_code`` says which kind when it ends the program."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(f"python_exec sandbox: {message}")
        self.exit_code = exit_code


def is_inside(workdir: str, path, dir_fd) -> bool:
    """Whether ``path`` (relative to ``dir_fd`` or the current directory) resolves inside ``workdir``."""
    if isinstance(path, int):
        return True  # a descriptor the program already holds
    base = os.getcwd() if dir_fd in (None, -1) else os.readlink(f"/proc/self/fd/{dir_fd}")
    named = os.path.join(base, os.fsdecode(path))
    full = os.path.realpath(named)
    return full == workdir or full.startswith(workdir + os.sep) or os.path.normpath(named) in WRITABLE_OUTSIDE


def install_hook(workdir: str, refuse_fork: bool) -> None:
    """Refuse what the sandbox does not allow; ``realpath`` raises no audit event, so no re-entry."""
    workdir = os.path.realpath(workdir)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, flags = args[0], args[2]
            if flags & WRITE_FLAGS and not is_inside(workdir, path, None):
                raise SandboxRefusal(
                    f"writing outside the working directory is not allowed ({path!r})", EXIT_REFUSED_WRITE
                )
        elif event in PATH_EVENTS:
            for index, fd_index in PATH_EVENTS[event]:
                if not is_inside(workdir, args[index], None if fd_index is None else args[fd_index]):
                    message = f"changing files outside the working directory is not allowed ({event} {args[index]!r})"
                    raise SandboxRefusal(message, EXIT_REFUSED_WRITE)
        elif event in NETWORK_EVENTS:
            raise SandboxRefusal(f"network access is disabled ({event})", EXIT_REFUSED_NETWORK)
        elif event in EXEC_EVENTS:
            raise SandboxRefusal(f"running other programs is not allowed ({event})", EXIT_REFUSED_EXEC)
        elif refuse_fork and event in FORK_EVENTS:
            raise SandboxRefusal(f"creating processes is not allowed ({event})", EXIT_REFUSED_FORK)

    sys.addaudithook(hook)


def exit_code_for(error: BaseException) -> int:
    """The code that names the limit an uncaught exception points to (1 for an ordinary error)."""
    if isinstance(error, SandboxRefusal):
        return error.exit_code
    if isinstance(error, MemoryError):
        return EXIT_MEMORY
    if isinstance(error, BlockingIOError) and error.errno == errno.EAGAIN:
        return EXIT_PROCESSES  # fork() over RLIMIT_NPROC
    if isinstance(error, RuntimeError) and "can't start new thread" in str(error):
        return EXIT_PROCESSES
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return EXIT_FILE_SIZE
    if isinstance(error, OSError) and error.errno == errno.EROFS:
        return EXIT_REFUSED_WRITE
    return 1


def main() -> None:
    config = json.loads(sys.argv[1])
    workdir = config["workdir"]  # also in every sandbox process's command line, where tests look for it
    with open("main.py", encoding="utf-8") as file:
        source = file.read()
    sys.argv = ["main.py"]
    sys.path.insert(0, workdir)  # as `python main.py` would: the program may import its own files
    install_hook(workdir, config["refuse_fork"])
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as error:  # printed as the interpreter would, minus this frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit(exit_code_for(error))


if __name__ == "__main__":
    main()
