"""The run's typed configuration: one dataclass per module, composed here.

The library never imports Hydra. `experiments/` composes YAML groups against this schema (a Hydra
structured config built from `RunConfig`, so unknown keys and wrong types fail at compose time), applies
`key=value` overrides through `dflash/overrides.py`, and hands a plain `RunConfig` to
`dflash.app.run.train`. Tests, sweeps and notebooks build `RunConfig`
directly or through the same compose helper.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dflash.errors import ConfigError  # noqa: F401  (defined below every layer; importable from here as before)
from dflash.devices import check_device
from dflash.training.buffer import BufferConfig, validate_buffer_config
from dflash.data.sources import DataConfig, validate_data_config, validate_online_data
from dflash.run_dir import CHECKPOINT_DIR, RunDir
from dflash.drafter.model import DrafterConfig, check_drafter_for_target, validate_drafter_config
from dflash.drafter.attention import ATTN_KERNELS
from dflash.evaluation import EvalConfig, validate_eval_config
from dflash.training.losses import LossConfig, validate_loss_config
from dflash.training.compiling import COMPILE_MODES
from dflash.training.noise import NoiseConfig, build_noise
from dflash.training.optim import OPTIMIZERS
from dflash.training.pipeline import PRODUCER_MODES, PRODUCER_STREAMS
from dflash.training.tau_probe import TauProbeConfig, validate_tau_probe_config
from dflash.serving.promotion import PromoteConfig
from dflash.target.model import TargetConfig, validate_target_config
from dflash.tracking.loggers import TrackingConfig


TIME_BUDGET_COUNTS = ("loop", "training")  # what trainer.time_budget_s counts (TrainerConfig.time_budget_counts)


@dataclass
class TrainerConfig:
    max_steps: int = 120
    sequences_per_step: int = 2  # sequences pulled from the buffer per optimizer step
    num_anchors: int = 16  # random anchors (blocks) per sequence, re-drawn every epoch
    lr: float = 1e-3
    # adamw | muon (Muon for the 2-D weights at muon_lr_scale x lr, each shape's matrices as one batch, AdamW for the
    # rest) | muon_torch (the same with torch.optim.Muon one matrix at a time; dflash/training/optim.py)
    optimizer: str = "adamw"
    muon_lr_scale: float = 10.0
    min_lr_ratio: float = 0.1  # the cosine's end as a fraction of lr, in [0, 1]
    warmup_steps: int = 10  # linear LR warmup (0: none)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm, > 0 (clipping is always on: a huge value leaves it idle)
    checkpoint_every: int = 50
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all)
    device: str = "auto"
    dtype: str = "float32"  # drafter parameter dtype (master weights)
    autocast: str = "auto"  # auto: bfloat16 autocast on GPU, off on CPU
    producers: int = 1  # target producer threads (deterministic buffers force 1)
    producer_batch: int = 1  # sequences a producer claims per target forward (grouped by length, right-padded)
    # thread: producer threads run the target beside the drafter; inline: the consumer runs the target itself
    # whenever the buffer runs short (no second thread); auto: inline when target and drafter share one GPU
    producer_mode: str = "auto"
    # the CUDA stream the target's forwards run on (dflash/training/pipeline.py PRODUCER_STREAMS): default (the
    # consumer's), or side (their own, so the drafter's queued work runs beside the target's forward; synchronised)
    producer_stream: str = "default"
    # torch.compile the drafter's forward (fuses its norms, RoPE and elementwise ops; one compile per batch
    # shape, so sequences are padded to `pad_multiple` tokens and every sequence gets num_anchors blocks)
    compile: bool = False
    # how it compiles (dflash/training/compiling.py): default | reduce-overhead (CUDA graphs) |
    # max-autotune-no-cudagraphs | max-autotune
    compile_mode: str = "default"
    pad_multiple: int = 1  # pad each batch's length up to a multiple of this (compile: e.g. 256)
    eval_every: int = 0  # steps between cheap evals (0 = only at the end)
    # consumed-token milestones at which the in-training eval also runs (a learning curve at fixed budgets,
    # e.g. [4000000, 16000000]: the first log interval at or past each one)
    eval_at_tokens: list[int] = field(default_factory=list)
    # train/tau_rounds: the evaluator's round simulation on a few training sequences per log interval
    tau_probe: TauProbeConfig = field(default_factory=TauProbeConfig)
    time_budget_s: float = 0.0  # stop at the first log interval past this many seconds (0: off; what they count:
    # time_budget_counts; train/budget_s logs the seconds counted so far);
    # the final checkpoint and full eval still run. For equal-time comparisons; the LR follows max_steps unless
    # schedule_by_time: then the cosine's progress is also pushed on by this job's clock (from its first step, so
    # compiling does not count) and a run the budget stops ends decayed (trainer.py, TimeProgress); a cosine noise
    # schedule still follows its own horizon (noise.steps, else max_steps)
    schedule_by_time: bool = False
    # what time_budget_s counts: "loop" (wall time from the loop's start: first data, compiling and in-training
    # evaluations inside it, a deadline a job can be sized by) or "training" (training alone: from the first step on,
    # the in-training evaluations' seconds left out, so short equal-time cells compare training, not how warm a
    # machine's caches were, and a learning curve's evaluations cost no training; sys/first_step_s and
    # sys/train_eval_s log what was left out)
    time_budget_counts: str = "loop"  # one of TIME_BUDGET_COUNTS
    token_budget: int = 0  # stop at the first log interval past this many consumed training tokens (0: off),
    # all ranks together; then checkpoint and evaluate, as for time_budget_s. For equal-token comparisons.
    online_data: bool = False  # train on sequences the target writes online (data.pool, data.online), whatever
    # data.source says (+trainer=gpu: on); the same as data.source=online


@dataclass
class RunConfig:
    seed: int = 0
    run_dir: str = ""  # empty → runs/<timestamp>-<loss>
    resume: str = ""  # a run directory to resume from its last checkpoint
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    promote: PromoteConfig = field(default_factory=PromoteConfig)


def _positive(section: str, obj: Any, *keys: str) -> None:
    for k in keys:
        if getattr(obj, k) <= 0:
            raise ConfigError(f"{section}.{k} must be > 0, got {getattr(obj, k)}")


def _non_finite(obj: Any, prefix: str = "") -> list[str]:
    """`section.key=value` for every NaN / ±inf number anywhere in the config (lists included)."""
    bad = []
    for f in dataclasses.fields(obj):
        v, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            bad += _non_finite(v, key + ".")
            continue
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, float) and not math.isfinite(x):
                bad.append(f"{key}={x}")
    return bad


def _trainer_ranges(cfg: RunConfig) -> None:
    t = cfg.trainer
    for key in ("warmup_steps", "eval_every", "keep_checkpoints", "weight_decay"):
        if getattr(t, key) < 0:
            raise ConfigError(f"trainer.{key} must be >= 0, got {getattr(t, key)}")
    if t.grad_clip <= 0:
        raise ConfigError(f"trainer.grad_clip must be > 0 (the max gradient norm; clipping is always on, a large "
                          f"value leaves it idle), got {t.grad_clip}")
    if any(n <= 0 for n in t.eval_at_tokens) or list(t.eval_at_tokens) != sorted(set(t.eval_at_tokens)):
        raise ConfigError(f"trainer.eval_at_tokens must be increasing consumed-token counts > 0, "
                          f"got {list(t.eval_at_tokens)}")
    try:
        validate_tau_probe_config(t.tau_probe, cfg.drafter.block_size)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if t.time_budget_counts not in TIME_BUDGET_COUNTS:
        raise ConfigError(f"trainer.time_budget_counts must be 'loop' or 'training' (what trainer.time_budget_s "
                          f"counts), got {t.time_budget_counts!r}")
    if t.schedule_by_time and t.time_budget_s <= 0:
        raise ConfigError("trainer.schedule_by_time=true needs trainer.time_budget_s > 0 (the seconds the LR's "
                          f"cosine spans), got trainer.time_budget_s={t.time_budget_s}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"trainer.min_lr_ratio must be in [0, 1] (the final LR as a fraction of trainer.lr), "
                          f"got {t.min_lr_ratio}")
    # draw_anchors: anchors a ∈ [1, length − block_size + 1], so a sequence holds at most that many blocks
    cap = cfg.data.max_len - cfg.drafter.block_size + 1
    if cap < 1:  # no anchor fits at all: the length is what is wrong, not the anchor count
        raise ConfigError(f"data.max_len={cfg.data.max_len} is shorter than drafter.block_size="
                          f"{cfg.drafter.block_size}: a sequence must hold at least one block")
    if t.num_anchors > cap:
        raise ConfigError(f"trainer.num_anchors={t.num_anchors} is more than a sequence allows: at most "
                          f"data.max_len - drafter.block_size + 1 = {cap} anchors per sequence")


def validate(cfg: RunConfig) -> None:
    """Every check that needs no weights; raises ConfigError naming the key. Reads the target's
    config.json (not its weights) for layer count and vocabulary."""
    try:
        bad = _non_finite(cfg)
        if bad:
            raise ConfigError(f"{', '.join(bad)}: every number must be finite (no NaN or inf)")
        if cfg.drafter.block_size < 2:
            raise ConfigError(f"drafter.block_size must be >= 2 (anchor + at least one prediction), "
                              f"got {cfg.drafter.block_size}")
        validate_loss_config(cfg.loss)
        _positive("trainer", cfg.trainer, "max_steps", "sequences_per_step", "num_anchors", "lr",
                  "checkpoint_every", "producers", "producer_batch", "pad_multiple")
        PRODUCER_MODES.check(cfg.trainer.producer_mode)
        OPTIMIZERS.check(cfg.trainer.optimizer)
        _positive("trainer", cfg.trainer, "muon_lr_scale")
        ATTN_KERNELS.check(cfg.drafter.attn_kernel)
        COMPILE_MODES.check(cfg.trainer.compile_mode)
        PRODUCER_STREAMS.check(cfg.trainer.producer_stream)
        _trainer_ranges(cfg)
        if cfg.trainer.time_budget_s < 0:
            raise ConfigError(f"trainer.time_budget_s must be >= 0 (0: off), got {cfg.trainer.time_budget_s}")
        if cfg.trainer.token_budget < 0:
            raise ConfigError(f"trainer.token_budget must be >= 0 (0: off), got {cfg.trainer.token_budget}")
        _positive("drafter", cfg.drafter, "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size")
        if cfg.drafter.num_heads % cfg.drafter.num_kv_heads:
            raise ConfigError("drafter.num_heads must be a multiple of drafter.num_kv_heads")
        if cfg.drafter.head_dim % 2:
            raise ConfigError("drafter.head_dim must be even (RoPE)")
        validate_drafter_config(cfg.drafter)  # layer_types / sliding_window / rope_theta
        if cfg.data.min_len < cfg.drafter.block_size:
            raise ConfigError(f"data.min_len={cfg.data.min_len} is shorter than drafter.block_size="
                              f"{cfg.drafter.block_size}: no anchor would fit")
        if cfg.tracking.log_every < 1:
            raise ConfigError("tracking.log_every must be >= 1")
        if cfg.resume and not (RunDir(cfg.resume).checkpoints.is_dir() or RunDir(cfg.resume).config_file.is_file()):
            raise ConfigError(f"resume={cfg.resume!r}: no {CHECKPOINT_DIR}/ folder there")
        validate_buffer_config(cfg.buffer)
        validate_data_config(cfg.data)
        if cfg.trainer.online_data:
            validate_online_data(cfg.data)
        build_noise(cfg.noise, cfg.trainer.max_steps)
        info = validate_target_config(cfg.target)
        check_drafter_for_target(cfg.drafter, info.hidden_size, info.vocab_size)
        validate_eval_config(cfg.eval)
        from dflash.evaluation.engines import resolve_policy
        resolve_policy(cfg.eval.engine, cfg.eval.proposal, cfg.drafter.is_dflash2)  # zlab serves no DFlash 2
        for key, name in (("trainer.device", cfg.trainer.device), ("target.device", cfg.target.device),
                          ("eval.device", cfg.eval.device)):
            check_device(key, name)
        _data_suites(cfg)
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def _data_suites(cfg: RunConfig) -> None:
    """eval.suite / extra_suites naming a suite the data builds (chat_heldout): only data that builds it."""
    from dflash.evaluation.prompts import DATA_SUITES
    for s in [cfg.eval.suite, *cfg.eval.extra_suites] if cfg.eval.enabled else []:
        if s in DATA_SUITES and cfg.data.source != "conversations":
            raise ConfigError(f"eval.suite={s}: built by {DATA_SUITES[s]}, but data.source={cfg.data.source}")
        if s == "chat_heldout" and (cfg.data.conversations.heldout_per_10k == 0
                                    or cfg.data.conversations.eval_prompts == 0):
            raise ConfigError("eval.suite=chat_heldout needs a held-out split: data.conversations.heldout_per_10k "
                              "and eval_prompts must be > 0")


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> RunConfig:
    """Strict: unknown keys raise ConfigError naming them (used for resolved configs on disk)."""
    return _build(RunConfig, d, "")


def _build(cls, d: dict, prefix: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}")
    kwargs = {}
    for name, value in d.items():
        sub = _dataclass_of(cls, name)
        kwargs[name] = _build(sub, value, f"{prefix}{name}.") if sub else value
    return cls(**kwargs)


def _dataclass_of(cls, name):
    default = next(f for f in dataclasses.fields(cls) if f.name == name)
    if default.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        obj = default.default_factory()  # type: ignore[misc]
        return type(obj) if dataclasses.is_dataclass(obj) else None
    return None
