"""An engine's worker process for the benchmarks: one JSON request per line on its stdin, one JSON answer per
line on a pipe of its own (whatever a library prints goes to stderr); `EngineUnavailable` when it cannot run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

from bench.entry import child_env
from hetero.threads import library_default_env, passive_env


class EngineUnavailable(Exception):
    """The engine cannot run here (e.g. llama-cpp-python not installed): skipped with this message."""


def worker_env(threads: int, own: bool) -> dict[str, str]:
    """The environment of an engine's process: the checkout on PYTHONPATH (`entry.child_env`), OMP_NUM_THREADS, and OpenMP's wait policy as hetero runs its own
    engines (`passive_env`) or, for another engine (`own` False), its default, as its users run it."""
    env = child_env({**os.environ, "OMP_NUM_THREADS": str(threads)})
    return passive_env(env) if own else library_default_env(env)


class WorkerProcess:
    """An engine's worker process and the pipe to it: one JSON request per line in, one JSON answer out."""

    def __init__(self, engine: str, cmd: list[str], env: dict[str, str]):
        self.engine = engine
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)

    def ask(self, req: dict | None = None) -> dict:
        """Send a request (None: just read the next answer); the answer, or {"failed": why}."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            if req is not None:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line)
        self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().strip().splitlines()[-1:]
        return {"failed": f"failed: {tail[0] if tail else 'exit ' + str(self.proc.returncode)}"}

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def answer_pipe() -> Callable[[dict], None]:
    """A worker's replies on its own pipe (the original stdout); whatever a library prints goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    return reply
