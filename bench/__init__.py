"""The benchmarks of hetero, run from a source checkout (not part of the installed package): one module per
benchmark, each also a script (`python bench/<name>.py`, `hetero bench <name>`, `bench.entry`); a harness that
times engines in subprocesses, simulated rows on device profiles, reports (JSON + markdown) and plots. Results go
to `<cache>/bench/`; the committed ones, written with `--out bench/results`, live in `bench/results/`; numbers never
live in docstrings (docs/design.md, "Where the numbers are", lists them with their commands)."""
