"""Math answers verified by Hugging Face's ``math-verify``: a :class:`~screl.envs.Verifier` for GSM8K, MATH and
DAPO-Math style data.

The answer is read from ``\\boxed{...}``, from GSM8K's ``#### 42``, or from the last number or expression of
the completion; the reference answer (``prompt.metadata[answer_key]``) likewise, so a GSM8K solution column
works as is. Equivalence is math-verify's: LaTeX and sympy (``\\frac{2}{4}`` = ``0.5``, ``2\\sqrt{2}`` =
``\\sqrt{8}``, intervals, sets).

**Timeouts.** Verification runs in a child process (``python -m screl.envs._verify_worker``), a batch per
call, because math-verify's own timeouts use ``signal.alarm`` (main thread only) and rewards run on the rollout
workers' executor threads, where a sympy call that hangs cannot be interrupted. An item past ``timeout_s`` has
its process killed (a new one starts for the rest of the batch). A verification that times out or raises is a
**data failure**: ``rewards`` raises :class:`MathVerifyError`, the workflow scores each completion alone, and
the failing sibling is resampled under ``failure.max_data_attempts`` (its group dropped once they run out),
never recorded as a zero reward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from screl.envs.base import PromptRecord, Verifier

KEY = "data.init_args.task.init_args.verifier.init_args"
_STARTUP_TIMEOUT_S = 120.0
_CACHE_SIZE = 8192
Result = tuple[Any, ...]
"""``("ok", parsable, correct)``, ``("timeout",)`` or ``("error", message)``."""


class MathVerifyError(RuntimeError):
    """A verification timed out or raised: a data failure (the sibling is resampled), not a reward."""


class _Child:
    """One verifier process and its line-buffered result pipe."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # screl importable even when not installed
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "screl.envs._verify_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        self._buf = b""
        if self.readline(_STARTUP_TIMEOUT_S) != ["ready"]:
            self.kill()
            raise MathVerifyError(f"the math-verify process did not start within {_STARTUP_TIMEOUT_S:.0f}s"
                                  " (is math-verify installed? pip install 'screl[tasks]')")

    def readline(self, timeout_s: float) -> Any:
        """The next JSON line, or None past ``timeout_s``; EOFError when the process died."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError(f"exit code {self.proc.poll()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def send(self, items: Sequence[tuple[str, str]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(list(items)) + "\n").encode())

    def kill(self) -> None:
        self._finalizer()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class MathVerify(Verifier):
    """1.0 for a completion whose final answer equals the reference answer under ``math-verify``, else 0.0; plus
    ``format_reward`` when the completion has an answer that parses.

    Args:
        timeout_s: Longest one verification (parsing both answers and comparing) may take; past it, the sibling is
            a data failure. Enforced by killing the verifier process, so it works off the main thread.
        format_reward: Added for a completion whose answer parses, right or wrong (0: pass/fail only).
        mask_unparsable: Mask completions with no parsable answer from the loss (``Task.masked``): they keep their
            reward in the group's baseline, but give no gradient.
        answer_key: The metadata key of the reference answer (``DatasetTask`` puts its ``answer_column`` there).
        processes: Verifier processes per rollout worker (concurrent reward batches share them).
    """

    def __init__(self, timeout_s: float = 10.0, format_reward: float = 0.0, mask_unparsable: bool = False,
                 answer_key: str = "answer", processes: int = 1) -> None:
        if not timeout_s > 0:
            raise ValueError(f"{KEY}.timeout_s={timeout_s} must be > 0 (seconds per verification)")
        if format_reward < 0:
            raise ValueError(f"{KEY}.format_reward={format_reward} must be >= 0")
        if processes < 1:
            raise ValueError(f"{KEY}.processes={processes} must be >= 1")
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("MathVerify needs the math-verify package: pip install 'screl[tasks]'")
        self.timeout_s, self.format_reward, self.mask_unparsable = float(timeout_s), float(format_reward), \
            mask_unparsable
        self.answer_key, self.processes = answer_key, processes
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Condition()
        self._idle: list[_Child] = []
        self._started = 0
        self._cache: OrderedDict[tuple[str, str], Result] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_idle", "_started", "_cache")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # -- the verifier -----------------------------------------------------------------------------------
    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        """Scores of a batch (one trip to a verifier process). Raises :class:`MathVerifyError` if any
        verification timed out or raised (the workflow then pins it on its sibling: a data failure)."""
        results = self.judge(prompts, completions)
        failures = [_message(p, r, self.timeout_s) for p, r in zip(prompts, results, strict=True) if r[0] != "ok"]
        if failures:
            many = f"{len(failures)} of {len(results)} verifications failed; " if len(results) > 1 else ""
            raise MathVerifyError(many + failures[0])
        return [float(r[2]) + (self.format_reward if r[1] else 0.0) for r in results]

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        """With ``mask_unparsable``: True when the completion has no answer that parses (raises on a failed
        verification, which the workflow also counts as masked)."""
        if not self.mask_unparsable:
            return False
        result = self.judge([prompt], [completion])[0]
        if result[0] != "ok":
            raise MathVerifyError(_message(prompt, result, self.timeout_s))
        return not result[1]

    def judge(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[Result]:
        """``("ok", parsable, correct)``, ``("timeout",)`` or ``("error", message)`` per completion (results are
        cached, so the workflow's retry of a failed batch, one completion at a time, costs no second run)."""
        if len(prompts) != len(completions):
            raise ValueError(f"MathVerify: {len(prompts)} prompts but {len(completions)} completions")
        keys = [(self._gold(p), str(c)) for p, c in zip(prompts, completions, strict=True)]
        with self._lock:
            todo = list(dict.fromkeys(k for k in keys if k not in self._cache))
        if todo:
            done = self._run(todo)
            with self._lock:
                for key, result in zip(todo, done, strict=True):
                    self._cache[key] = result
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
                fresh = dict(zip(todo, done, strict=True))
        else:
            fresh = {}
        with self._lock:
            return [fresh[k] if k in fresh else self._cache[k] for k in keys]

    def _gold(self, prompt: PromptRecord) -> str:
        if self.answer_key not in prompt.metadata or prompt.metadata[self.answer_key] is None:
            raise MathVerifyError(f"prompt {prompt.prompt_id} has no reference answer metadata[{self.answer_key!r}]"
                                  f" ({KEY}.answer_key; DatasetTask's answer_column)")
        return str(prompt.metadata[self.answer_key])

    # -- the processes ----------------------------------------------------------------------------------
    def _run(self, items: list[tuple[str, str]]) -> list[Result]:
        child = self._acquire()
        results: list[Result] = []
        try:
            while len(results) < len(items):
                if child is None:
                    child = _Child()
                try:
                    child.send(items[len(results):])
                except OSError:  # the idle process died (killed from outside): start another, once
                    child.kill()
                    child = _Child()
                    child.send(items[len(results):])
                while len(results) < len(items):
                    try:
                        line = child.readline(self.timeout_s)
                    except EOFError as err:
                        line, died = None, str(err)
                    else:
                        died = ""
                    if line is None:  # past the timeout, or the process died: kill it, go on in a new one
                        child.kill()
                        child = None
                        results.append(("error", f"the verifier process died ({died})") if died else ("timeout",))
                        break
                    results.append(tuple(line[1:]))
        finally:
            self._release(child)
        return results

    def _acquire(self) -> _Child | None:
        """An idle process, or None (start one) while fewer than ``processes`` run; else wait for one."""
        with self._lock:
            while not self._idle and self._started >= self.processes:
                self._lock.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
            return None

    def _release(self, child: _Child | None) -> None:
        with self._lock:
            if child is None:
                self._started -= 1
            else:
                self._idle.append(child)
            self._lock.notify()

    def close(self) -> None:
        """Stop the idle verifier processes (they also stop when this process exits)."""
        with self._lock:
            while self._idle:
                self._idle.pop().kill()
                self._started -= 1


def _message(prompt: PromptRecord, result: Result, timeout_s: float) -> str:
    if result[0] == "timeout":
        return (f"math-verify ran past timeout_s={timeout_s:g} on prompt {prompt.prompt_id} ({KEY}.timeout_s):"
                " a data failure, the sibling is resampled")
    return f"math-verify failed on prompt {prompt.prompt_id}: {result[1]}"
