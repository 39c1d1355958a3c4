"""The QNN HTP path against the INT8 reference, simulated (mllm-NPU §3.2-§3.3); `hetero.bench.htp_accuracy`.

    python bench/htp_accuracy.py [--e2e] [--json]       # writes bench/results/htp_accuracy.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("htp_accuracy", sys.argv[1:]))
