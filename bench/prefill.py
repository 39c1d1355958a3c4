"""Prefill benchmark: hetero vs hetero in-order vs naive NPU vs torch float vs the peers (OpenVINO GenAI, ONNX
Runtime GenAI, llama.cpp at its fastest formats and as shipped; issue 24), mllm-NPU §4.2-4.3.

    python bench/prefill.py [--quick] [--json] [--lens 64,256,1024,2048] [--repeats 3] [--threads 2]

The peers need the `bench` extra; OpenVINO's model is exported by optimum-intel's optimum-cli, named by
$HETERO_OPTIMUM_CLI, ONNX Runtime GenAI's builder by the Python $HETERO_ORT_GENAI_PYTHON names (`make bench` makes
both venvs). A missing peer is skipped with the reason in the results.

Writes bench/results/prefill.{json,md} and prefill_*.png (the same run as `hetero bench prefill`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("prefill", sys.argv[1:]))
