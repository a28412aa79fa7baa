"""Run ``python ARGS`` inside a process that is already running Python: a child forked from a warm interpreter (the
worker zygote, :mod:`screl.dataplane.worker_zygote`; the tests' launcher, ``tests/_launch.py``) becomes the program a
fresh interpreter would have run, and ends as that interpreter would."""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
from pathlib import Path
from typing import Any


def run_as_main(args: list[str]) -> int:
    """Run ``python *args`` (``-m module``, ``-c code`` or a script, then its arguments) in this process as
    ``__main__``, then the interpreter's exit (non-daemon threads joined, ``atexit`` run, output flushed); its exit
    code."""
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as done:
        code = _exit_code(done.code)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1
