"""The frozen target (docs/DESIGN.md, "The target and its kernels").

- `model`: `Target` (hidden states at `layer_ids`, greedy labels, top-k soft labels), `TargetConfig`,
  `validate_target_config`, `default_layer_ids`, tiny random hybrid targets, the shipped reference target.
- `kernels`: which Gated-DeltaNet kernels transformers runs, and switching them (`preflight_kernels`,
  `kernel_report`, `torch_gdn_path`).
- `cache`: driving the decoder with its own cache (`new_hf_cache`, `cache_kwarg`).
- `assets`: the package's shipped targets, their weights packed as `.xz` and unpacked once into the user's cache
  (`shipped_folder`, what `builtin:NAME` resolves to; `python -m dflash.target.assets pack FOLDER` ships a folder).
"""
