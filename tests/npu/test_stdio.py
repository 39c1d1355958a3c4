"""Native banners go to stderr, hetero's own stdout text stays on stdout, in order (`hetero.npu.stdio`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import hetero.npu.stdio

SCRIPT = textwrap.dedent("""
    import ctypes, importlib.util, os, sys, threading
    spec = importlib.util.spec_from_file_location("stdio", sys.argv[1])  # the module alone: no torch to import
    stdio = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stdio)
    stdout_to_stderr = stdio.stdout_to_stderr

    libc = ctypes.CDLL(None)
    print("before")
    with stdout_to_stderr():
        os.write(1, b"raw-banner\\n")  # what the QNN simulator does: straight to file descriptor 1
        libc.printf(b"c-buffered-banner\\n")  # C stdio: buffered while fd 1 is a pipe
        print("during")  # hetero's own text: stays in sys.stdout's buffer, out after the block
        started, go = threading.Barrier(2), threading.Event()

        def other():
            with stdout_to_stderr():  # a second thread's block: shares the redirection
                started.wait()
                go.wait()
                os.write(1, b"thread-banner\\n")

        t = threading.Thread(target=other)
        t.start()
        started.wait()
    os.write(1, b"outer-left-banner\\n")  # the other block still runs: still redirected
    go.set()
    t.join()
    print("after")
    sys.stdout.flush()
    os.write(1, b"restored\\n")
""")


def test_native_writes_go_to_stderr_and_python_text_stays_on_stdout():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as by default
    r = subprocess.run([sys.executable, "-c", SCRIPT, hetero.npu.stdio.__file__], capture_output=True, text=True, timeout=60, check=True, env=env)
    assert r.stdout.split() == ["before", "during", "after", "restored"]
    for banner in ("raw-banner", "c-buffered-banner", "thread-banner", "outer-left-banner"):
        assert banner in r.stderr.split()
