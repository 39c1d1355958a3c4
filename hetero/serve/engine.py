"""One thread runs every request's model work, interleaved at chunk granularity.

A request is a generator that yields after each unit of work (one restored block, one prefill chunk,
one decoded token); the loop admits up to `max_active` requests and steps them round-robin, so a long
prompt never freezes a short chat. Requests on the same context run one after another (they share its
K/V). The queue of waiting requests is bounded: a full queue is refused at once (`QueueFull`, HTTP 429).
A cancelled request (client gone) is closed at its next step, which releases what it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from hetero.errors import HeteroError

log = logging.getLogger(__name__)

Sink = Callable[[str, object], None]  # (kind: "token" | "done" | "error", payload)


class QueueFull(HeteroError):
    """The request queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """A request: `start()` builds its step generator when the engine admits it."""

    start: Callable[["Job"], Generator[None, None, None]]
    sink: Sink
    key: str | None = None  # jobs with the same key (a context id) never run at the same time
    bounded: bool = True  # counts against the queue bound (control jobs like deletes do not)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    gen: Generator[None, None, None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    def __init__(self, max_active: int = 4, max_queue: int = 16):
        self.max_active, self.max_queue = max_active, max_queue
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._cv = threading.Condition()
        self._stop = False
        self.steps = 0
        self.step_s = 0.05  # running mean of one step's wall time (for Retry-After)
        self._thread = threading.Thread(target=self._loop, name="hetero-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._stop:
                raise QueueFull("the server is shutting down", retry_after=1.0)
            # requests the loop will admit at its next turn (free active slots) are not waiting
            waiting = sum(j.bounded for j in self._pending) - max(0, self.max_active - len(self._active))
            if job.bounded and waiting >= self.max_queue:
                raise QueueFull(f"request queue full ({waiting} waiting, limit {self.max_queue})",
                                retry_after=max(1.0, round(self.step_s * 64, 1)))
            self._pending.append(job)
            self._cv.notify()
        return job

    def load(self) -> dict:
        with self._cv:
            return {"active": len(self._active), "queued": len(self._pending), "max_active": self.max_active,
                    "max_queue": self.max_queue, "steps": self.steps}

    def _admit(self) -> None:
        busy = {j.key for j in self._active if j.key is not None}
        for job in list(self._pending):
            if len(self._active) >= self.max_active:
                break
            if job.key is not None and job.key in busy:
                continue
            self._pending.remove(job)
            if job.cancelled.is_set():
                continue
            if job.key is not None:
                busy.add(job.key)
            self._active.append(job)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._admit()
                while not self._active and not self._stop:
                    self._cv.wait()
                    self._admit()
                if self._stop and not self._active:
                    return
                batch = list(self._active)
            for job in batch:
                self._step(job)

    def _step(self, job: Job) -> None:
        t0 = time.perf_counter()
        done = False
        try:
            if job.gen is None:
                job.gen = job.start(job)
            if job.cancelled.is_set():
                job.gen.close()
                done = True
            else:
                next(job.gen)
        except StopIteration:
            done = True
        except Exception as e:  # one request's failure never stops the engine
            if not isinstance(e, HeteroError):
                log.exception("request failed")
            job.sink("error", e)
            done = True
        self.steps += 1
        self.step_s += 0.05 * (time.perf_counter() - t0 - self.step_s)
        if done:
            with self._cv:
                self._active.remove(job)
                self._cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new work, cancel what is queued or running, and wait for the loop to end."""
        with self._cv:
            self._stop = True
            for job in list(self._pending) + self._active:
                job.cancel()
            for job in self._pending:
                job.sink("error", QueueFull("the server is shutting down", retry_after=1.0))
            self._pending.clear()
            self._cv.notify()
        self._thread.join(timeout)
