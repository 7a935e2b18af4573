"""Training a drafter against a frozen target (docs/DESIGN.md, "Losses and noise", "The buffer").

- `trainer`: `Trainer`, handed its components (`TrainParts`): the step API `make_batch` / `step`, the loop
  `run` (metrics from device accumulators every N steps, checkpoints, resume, a stop at a step boundary).
  `hooks`: `LoopHooks`, what the loop calls out to; the run around it is composed in dflash/app/run.py.
- `pipeline`: producers (target forwards) feeding `Item`s into the buffer (`ProducerPool`, `ItemSource`;
  `PRODUCER_MODES`, and `PRODUCER_STREAMS`: the forwards on the consumer's stream or on a side stream).
- `compiling`: `compile_drafter` in one of `COMPILE_MODES` (inductor, CUDA graphs, autotuned matmuls).
- `buffer`: the length-bucketed, bounded `BucketedBuffer` with its pull policies (`BufferConfig`).
- `batching`: random anchors and the drafter batch (`make_batch`, `DrafterBatch`).
- `losses`: the losses (`build_loss`, `LossConfig`; each a per-position term from `TERMS` and a
  position weighting from `WEIGHTINGS`, computing its own LM-head stats); `position_stats` and `lm_head_loss`:
  those stats in LM-head chunks (`compute_position_stats`: the recompute path and the fused one).
- `noise`: noise schedules on the target features (`build_noise`, `NoiseConfig`).
- `checkpoint`: atomic step checkpoints that load as plain data, each with a sha256 (`save_checkpoint`,
  `load_checkpoint`, `intact_checkpoint`: the newest that verifies, falling back past torn ones, `CheckpointError`).
- `interrupts`: SIGTERM / SIGINT stop at a step boundary with a checkpoint, or at once where there is none
  (`StopOnSignal`, `RunInterrupted`).
- `health`: a dead drafter (loss at ln V, zero gradient) ends the run FAILED (`check_alive`, `DeadDrafterError`).
- `distributed`: torchrun data parallelism (`init_distributed`, `wrap_ddp`).
"""
