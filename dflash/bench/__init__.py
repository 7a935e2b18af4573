"""The benchmark behind `experiments.bench`: target, drafter, back-to-back and pipeline throughput, MFU
against a measured matmul peak, the step's sync sites and kernel breakdown, and what τ buys in serving.

- `config`: `BenchConfig` (the `bench.*` keys), the before/after variants.
- `runner`: `run_bench` and its section registry `SECTIONS` (peak, target, target_torch, drafter, pipeline, serving).
- `drafter_step`: `DrafterStepBench`, the trainer's own `Trainer.step` on a synthetic batch, with its phases.
- `pipeline`: `bench_pipeline`, the headline: tokens trained on per second over repeated windows.
- `serving_speed`: `bench_serving`, decode / verify / draft times after long contexts, τ → × greedy.
- `flops`: FLOP counting (fused attention included), the matmul peak, a synchronised timer.
- `profiling`: counting blocking CUDA calls in traced steps and grouping kernels by family.
- `table`: `format_table`, the printed table.
"""
