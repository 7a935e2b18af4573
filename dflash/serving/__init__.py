"""From a trained drafter to a served one (docs/DESIGN.md, "Evaluation and the gate"; docs/serving.md).

- `export`: the serving folder (`config.json` with `DFlashDraftModel` and the target's facts the engines read,
  safetensors with the reference tensor names, `modeling_dflash.py` for `AutoModel` + trust_remote_code):
  `write_serving_folder`, `load_drafter` (ours or a published drafter), `read_target_facts`.
- `modeling_dflash`: that modelling file's source (torch + transformers only; copied, never imported by us).
- `promotion`: the gate that registers an evaluated checkpoint in the MLflow Model Registry and moves the
  serving alias only when it beats the holder (`promote`, `auto_promote`, `PromoteConfig`).
"""
