"""The benchmark behind `experiments.bench`: target, drafter, back-to-back and pipeline throughput, MFU
against a measured matmul peak, and the step's sync sites and kernel breakdown.

- `runner`: `BenchConfig`, `run_bench`, `format_table`.
- `profiling`: counting blocking CUDA calls in a traced step and grouping kernels by family.
"""
