"""`hetero.timing.process_age_s`: what `hetero -v run` reports as its imports (the process's start-up)."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from hetero.timing import process_age_s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/stat")
def test_process_age_is_the_time_since_this_process_started():
    a = process_age_s()
    time.sleep(0.2)
    b = process_age_s()
    assert a is not None and b is not None and 0.15 <= b - a <= 2.0  # it advances with the clock
    # psutil's start time has whole-second resolution on Linux (the boot time): equal within it
    assert abs(b - (time.time() - psutil.Process().create_time())) < 1.5
