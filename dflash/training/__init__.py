"""Training a drafter against a frozen target (DESIGN §2–§4).

- `trainer`: `train(cfg) -> TrainResult`, `Trainer` (the step, logging every N steps from device
  accumulators, eval, checkpoint, resume).
- `pipeline`: producers (target forwards) feeding `Item`s into the buffer (`ProducerPool`, `ItemSource`).
- `buffer`: the length-bucketed, bounded `BucketedBuffer` with its pull policies (`BufferConfig`).
- `batching`: random anchors and the drafter batch (`make_batch`, `DrafterBatch`).
- `losses`, `lm_head_loss`: the loss variants (`build_loss`, `LossConfig`) and the fused, chunked LM-head path.
- `noise`: noise schedules on the target features (`build_noise`, `NoiseConfig`).
- `checkpoint`: atomic step checkpoints that load as plain data, each with a sha256 (`save_checkpoint`,
  `load_checkpoint`, `intact_checkpoint`: the newest that verifies, falling back past torn ones, `CheckpointError`).
- `interrupts`: SIGTERM / SIGINT stop at a step boundary with a checkpoint (`StopOnSignal`, `RunInterrupted`).
- `health`: a dead drafter (loss at ln V, zero gradient) ends the run FAILED (`check_alive`, `DeadDrafterError`).
- `distributed`: torchrun data parallelism (`init_distributed`, `wrap_ddp`).
"""
