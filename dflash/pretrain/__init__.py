"""Pretraining the shipped reference target (`experiments.pretrain_target`).

- `recipe`: `PretrainConfig`, `pretrain` (corpus, tokenizer, a small `qwen3_5` hybrid, atomic folder write).
"""
