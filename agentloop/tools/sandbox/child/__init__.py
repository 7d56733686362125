"""Code that runs inside the sandbox's own processes (standard library only).

The host starts ``bootstrap`` with this directory on ``sys.path``; ``bootstrap`` execs the program's
interpreter on the text of ``guard``. The host imports only ``guard``'s exit codes.
"""
