"""Pretraining the shipped reference target (the application behind `experiments.pretrain_target`).

- `config`: `PretrainConfig` and its checks.
- `data`: corpus, tokenizer and cached token streams (`prepare_data`), the resumable `WindowSampler`.
- `model`: the `qwen3_5` model, its size, the Gated-DeltaNet kernels it trains with.
- `loop`: the training loop and its resume checkpoint (`PretrainLoop`, `checkpoint_path`).
- `evaluate`: NLL, unigram baseline, probes, greedy continuations, prompt-lookup τ.
- `report`: the results markdown.
- `recipe`: `pretrain(cfg, prompts)`, one job: data → model → train (resumed) → score → folder → report.
"""
