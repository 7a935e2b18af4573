"""From a trained drafter to a served one (DESIGN §5 "Promotion", §6).

- `export`: the serving folder (`config.json` with `DFlashDraftModel`, safetensors with the reference tensor
  names): `write_serving_folder`, `load_drafter` (ours or a published drafter).
- `promotion`: the gate that registers an evaluated checkpoint in the MLflow Model Registry and moves the
  serving alias only when it beats the holder (`promote`, `auto_promote`, `PromoteConfig`).
"""
