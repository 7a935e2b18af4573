"""dflash: train DFlash block-diffusion speculative drafters, tracked in MLflow.

The packages follow the data path, corpus → target → buffer → drafter → loss → tracker:

- `dflash.data`: what the target reads — the code corpus and its file split, training sequences, target-written
  (regenerated) continuations.
- `dflash.target`: the frozen target model (hidden states, labels, soft labels), its Gated-DeltaNet kernels and
  decode-cache helpers.
- `dflash.drafter`: the DFlash drafter (KV injection, block diffusion) and its attention kernels.
- `dflash.training`: the trainer, producers and the length-bucketed buffer, batching, losses, feature noise,
  checkpoints, data parallelism.
- `dflash.evaluation`: acceptance length τ on cached ground truth (vanilla, DDTree), real speculative decoding.
- `dflash.tracking`: loggers (console, JSONL, MLflow), system metrics, the analysis behind the notebooks.
- `dflash.serving`: export to the serving format and import, the promotion gate (MLflow Model Registry).
- `dflash.app`: a training run composed (run folder, resume, loggers, evaluation, export, promotion) around the
  training loop; "auto" settings resolved once; export of a drafter a path names; write-ahead for campaigns.
- `dflash.bench`, `dflash.pretrain`: the applications behind `experiments.bench` and `experiments.pretrain_target`.

Top-level modules: `config` (the strict run schema), `registry` (the one name → variant table every choice by
name uses), `errors` (`ConfigError`, raisable from every layer), `devices`, `atomic` (all-or-nothing file
writes, with the umask's file modes), `run_dir` (the run folder's layout and resume state, `RunDir`, and
`resolve_drafter_source`: which drafter a run folder / serving folder / checkpoint path means).
"""
__version__ = "0.1.0"
