"""Benchmarks behind `bench/*.py` and `hetero bench`: a harness that times engines in subprocesses,
simulated rows on device profiles, reports (JSON + markdown) and plots. Results are committed under
`bench/results/`; numbers never live in docstrings (docs/design.md, "Where the numbers are", lists them with their commands)."""
