"""The engine: round-robin interleaving, per-context serialisation, the queue bound, cancellation, failures."""

from __future__ import annotations

import threading
from collections.abc import Generator

import pytest

from hetero.errors import ConfigError
from hetero.serve.engine import Engine, Job, QueueFull


class Recorder:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.events: dict[str, list] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def job(self, name: str, steps: int, key: str | None = None, gate: threading.Event | None = None,
            fail_at: int | None = None) -> Job:
        def start(job: Job) -> Generator[None, None, None]:
            try:
                for i in range(steps):
                    if gate is not None:
                        gate.wait(10)
                    if i == fail_at:
                        raise ConfigError(f"{name} failed")
                    with self.lock:
                        self.log.append(name)
                    yield
                job.sink("done", name)
            finally:
                with self.lock:
                    self.log.append(f"{name}:closed")

        def sink(kind: str, payload: object) -> None:
            self.events.setdefault(name, []).append((kind, payload))

        return Job(start, sink, key=key)


def wait_closed(rec: Recorder, *names: str) -> None:
    for _ in range(400):
        if all(f"{n}:closed" in rec.log for n in names):
            return
        threading.Event().wait(0.025)
    raise AssertionError(f"not finished: {names}: {rec.log}")


def test_a_short_request_is_not_frozen_by_a_long_one() -> None:
    engine, rec = Engine(max_active=2), Recorder()
    gate = threading.Event()
    engine.submit(rec.job("long", 50, gate=gate))
    engine.submit(rec.job("short", 3, gate=gate))
    gate.set()
    wait_closed(rec, "long", "short")
    engine.close()
    assert rec.log.index("short:closed") < 10  # interleaved step by step, not after the long one's 50
    assert rec.events["short"] == [("done", "short")]


def test_same_context_runs_one_after_another() -> None:
    engine, rec = Engine(max_active=4), Recorder()
    engine.submit(rec.job("a", 5, key="ctx"))
    engine.submit(rec.job("b", 5, key="ctx"))
    wait_closed(rec, "a", "b")
    engine.close()
    assert rec.log == ["a"] * 5 + ["a:closed"] + ["b"] * 5 + ["b:closed"]


def test_queue_bound_cancel_and_failure() -> None:
    engine, rec = Engine(max_active=1, max_queue=1), Recorder()
    gate = threading.Event()
    running = engine.submit(rec.job("running", 1000, gate=gate))
    while engine.load()["active"] == 0:
        threading.Event().wait(0.01)
    engine.submit(rec.job("failing", 3, fail_at=1))
    with pytest.raises(QueueFull) as e:
        engine.submit(rec.job("refused", 1))
    assert e.value.retry_after >= 1
    running.cancel()  # the client went away: closed at its next step, its finally runs
    gate.set()
    wait_closed(rec, "running", "failing")
    engine.close()
    assert rec.log.count("running") < 1000
    kind, err = rec.events["failing"][-1]
    assert kind == "error" and "failing failed" in str(err)


def test_shortest_remaining_prefill_runs_first_with_aging() -> None:
    """Two prefilling jobs: the shorter one is stepped alone until it decodes; a long one that has waited
    long enough (aging) is not overtaken."""
    import time

    from hetero.serve.engine import AGING_TOKENS_PER_S

    log: list[str] = []
    done = threading.Event()
    gate = threading.Event()

    def prefill(name: str, steps: int) -> object:
        def start(job: Job) -> Generator[None, None, None]:
            gate.wait(10)
            size = job.remaining
            for _ in range(steps):
                log.append(name)
                job.remaining -= size // steps
                yield
            job.remaining = 0
            log.append(f"{name}:decode")
            if name == "late":
                done.set()

        return start

    engine = Engine(max_active=4, max_queue=4)
    try:
        engine.submit(Job(prefill("long", 4), lambda k, p: None, remaining=4000))
        engine.submit(Job(prefill("short", 2), lambda k, p: None, remaining=100))
        old = Job(prefill("late", 2), lambda k, p: None, remaining=3000)
        old.submitted -= 3000 / AGING_TOKENS_PER_S + 5  # waited long enough: its score is below a fresh short one
        engine.submit(old)
        time.sleep(0.2)
        gate.set()
        assert done.wait(10)
    finally:
        engine.close()
    first = [n for n in log if not n.endswith(":decode")]
    assert first[:4] == ["late", "late", "short", "short"], log
    assert log.index("long") > log.index("short:decode") > log.index("late:decode")
