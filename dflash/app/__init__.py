"""The application layer: what composes a run out of the library below it.

- `run`: one training run (`train(cfg)`, `TrainingRun`): the run folder, resume, loggers, evaluation, the
  final export and promotion around the loop of dflash/training/trainer.py, which it reaches through hooks.
- `auto`: every "auto" setting (0 or "auto") resolved once, before anything is logged (`resolve_auto`).
- `export`: which drafter a path means, exported to the serving folder (`export_drafter`).
- `write_ahead`: what many runs of one campaign or sweep share, made once before they start.
- `chat_data`: a run's data for a chat dataset (`data.source=conversations`: loss masks, the data's own eval
  suites), and `build_run_data`, every source's data; `regen_shards`: the target's responses written ahead
  (`python -m experiments.regen`).

Nothing below this package imports it (the layering contract in pyproject.toml, checked by
tests/test_layers.py).
"""
