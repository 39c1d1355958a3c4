"""One thread runs every request's model work, interleaved between slices of work.

A request is a generator that yields after each unit of work (a slice of restore copies, a slice of its
one prefill plan, one decoded token). Requests on the same context run one after another (they share its
K/V). The queue of waiting requests is bounded: a full queue is refused at once (`QueueFull`, HTTP 429).
A cancelled request (client gone) is closed at its next step, which releases what it holds.

Scheduling is shortest-remaining-prefill first with aging: a job's `remaining` is its prefill tokens still
to run (an estimate until its prefix is matched, 0 once it decodes). Admission takes waiting jobs by the
score `remaining - AGING_TOKENS_PER_S · waited seconds`; each round steps every decoding job and the one
prefilling job of the lowest score, so a short new turn overtakes a long prompt at the long prompt's next
slice boundary, and a long prompt that waited long enough is not overtaken any more (nothing starves).
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
AGING_TOKENS_PER_S = 256.0  # one second of waiting is worth this many prefill tokens (SRPF with aging)

Sink = Callable[[str, object], None]  # (kind: "token" | "done" | "error", payload)


class QueueFull(HeteroError):
    """The request queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(QueueFull):
    """The server is stopping: queued requests are refused and running ones end with this error."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down", retry_after=1.0)


@dataclass(eq=False)
class Job:
    """A request: `start()` builds its step generator when the engine admits it."""

    start: Callable[["Job"], Generator[None, None, None]]
    sink: Sink
    key: str | None = None  # jobs with the same key (a context id) never run at the same time
    bounded: bool = True  # counts against the queue bound (control jobs like deletes do not)
    remaining: int = 0  # prefill tokens still to run (an estimate until matched); 0: decoding or control
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    gen: Generator[None, None, None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def score(self, now: float) -> float:
        """SRPF with aging: lower runs first."""
        return self.remaining - AGING_TOKENS_PER_S * (now - self.submitted)


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
                raise ShuttingDown()
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

    def contended(self) -> bool:
        """Whether a request other than the running one waits for the engine thread (a prefill slice asks
        this before pausing; an unlocked read: a stale answer costs one slice)."""
        return len(self._active) > 1 or bool(self._pending) or self._stop

    def _admit(self) -> None:
        busy = {j.key for j in self._active if j.key is not None}
        now = time.perf_counter()
        for job in sorted(self._pending, key=lambda j: j.score(now)):  # stable: FIFO among equals
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
                batch = self._round()
            for job in batch:
                self._step(job)

    def _round(self) -> list[Job]:
        """Every decoding (or control) job, and the prefilling job of the lowest score."""
        now = time.perf_counter()
        prefilling = [j for j in self._active if j.remaining > 0]
        first = min(prefilling, key=lambda j: j.score(now)) if prefilling else None
        return [j for j in self._active if j.remaining == 0 or j is first]

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

    def stop(self) -> None:
        """Refuse new work and end what is queued or running with `ShuttingDown` (a stream gets its error
        event at once); returns without waiting for the loop (see `close`)."""
        with self._cv:
            if self._stop:
                return
            self._stop = True
            for job in list(self._pending) + self._active:
                job.cancel()
                job.sink("error", ShuttingDown())
            self._pending.clear()
            self._cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        """`stop`, then wait for the loop to end (running jobs are closed at their next step)."""
        self.stop()
        self._thread.join(timeout)

    def submit_control(self, fn: Callable[[], object], key: str | None = None) -> object:
        """Run `fn` on the engine thread (it owns the store) and return its result; for short control work
        (a flush, a save). Raises what `fn` raised."""
        import queue

        q: queue.Queue = queue.Queue()

        def start(job: Job) -> Generator[None, None, None]:
            job.sink("done", fn())
            return
            yield

        self.submit(Job(start, lambda kind, payload: q.put((kind, payload)), key=key, bounded=False))
        kind, payload = q.get()
        if kind == "error":
            raise payload
        return payload
