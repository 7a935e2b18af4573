"""The training loop, resumable from its own checkpoint.

Token windows from `WindowSampler`, AdamW (decay on matrices only) + linear warmup + cosine over
`max_steps` (with `schedule_by_time`, also pushed on by this job's wall clock), bf16 autocast on GPU,
gradient clipping. The loss is accumulated on the device and read every `log_every` steps (the loop's only
host sync). Every `eval_every` steps the `val` loss is measured and the best snapshot kept (CPU copy).

Resume: `checkpoint_path(cfg, run_dir)` holds the model, optimizer, sampler position, step, best snapshot,
accumulated train time, the tokenizer and the MLflow run id, written atomically every `checkpoint_every`
steps and whenever a job stops. A job that finds it continues the same run (same LR schedule, same window
order, same MLflow run), so jobs of a few minutes each add up to one pretraining; a checkpoint made for a
different corpus or model shape is refused, naming what differs.
"""
from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dflash.atomic import atomic_write
from dflash.pretrain.config import PretrainConfig
from dflash.pretrain.data import WindowSampler
from dflash.pretrain.evaluate import evaluate_nll, eval_windows, lm_loss
from dflash.safe_load import UnsafeFileError, load_plain
from dflash.training.trainer import warmup_cosine

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
# settings a resumed job must share with the checkpoint (others — budgets, eval cadence, outputs — may change)
RESUME_KEYS = ("data", "math_problems", "math_eval_problems", "math_seed", "tokenizer_split_digits",
               "vocab_size", "tokenizer_min_frequency", "tokenizer_sample_bytes", "tokenizer_split_newlines",
               "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
               "linear_num_key_heads", "linear_num_value_heads", "linear_head_dim", "linear_conv_kernel_dim",
               "tie_word_embeddings", "seq_len", "batch_size", "max_steps", "lr", "min_lr_ratio", "warmup_steps",
               "weight_decay", "beta1", "beta2", "seed", "keep_best")


@dataclass
class LoopState:
    step: int = 0
    train_seconds: float = 0.0  # over every job of the run
    best_loss: float = math.inf
    best_step: int = 0
    best_state: dict | None = None
    stop_reason: str = ""
    jobs: int = 0  # jobs that trained this run (this one included)
    history: list = field(default_factory=list)  # (job, first step, last step, seconds)


def lr_at(cfg: PretrainConfig, step: int, time_frac: float) -> float:
    """The trainer's warmup + cosine, whose progress is also pushed on by the wall clock (`time_frac`)."""
    return cfg.lr * warmup_cosine(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, time_frac)


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: PretrainConfig, model, device: torch.device):
    opt_kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=1e-8, **opt_kw)


def training_loss_fn(cfg: PretrainConfig, model, amp_dtype):
    """ids_BT -> mean next-token loss, compiled per `cfg.compile` (the windows have one fixed shape, so one
    graph serves the whole run; its compile time counts as training time)."""
    def loss_fn(ids_BT):
        return lm_loss(model, ids_BT, amp_dtype)
    if cfg.compile == "off":
        return loss_fn
    return torch.compile(loss_fn, mode=None if cfg.compile == "default" else cfg.compile, dynamic=False)


def train_step(model, opt, loss_fn, ids_BT: torch.Tensor, grad_clip: float):
    """One optimizer step on a batch: (loss, grad norm before clipping), both still on the device."""
    loss = loss_fn(ids_BT)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), gnorm


# -- checkpoint ---------------------------------------------------------------------------------------
def checkpoint_path(cfg: PretrainConfig, run_dir: Path) -> Path:
    return Path(cfg.state_dir or run_dir / "state") / "pretrain_state.pt"


def resume_signature(cfg: PretrainConfig, corpus_fingerprint: str) -> dict:
    return {"format": CHECKPOINT_FORMAT, "corpus": corpus_fingerprint, **{k: getattr(cfg, k) for k in RESUME_KEYS}}


def read_checkpoint(path: Path) -> dict | None:
    """The saved pretraining state (plain data only: a file that would run code raises UnsafeFileError)."""
    if not path.is_file():
        return None
    state = load_plain(path, "cpu", what="pretraining state")
    if not isinstance(state, dict) or "signature" not in state:
        raise UnsafeFileError(f"{path}: not a pretraining state file (no signature)")
    return state


def check_resumable(ckpt: dict, cfg: PretrainConfig, corpus_fingerprint: str, path: Path) -> None:
    want, have = resume_signature(cfg, corpus_fingerprint), ckpt["signature"]
    diff = [f"{k}: checkpoint {have.get(k)!r}, now {v!r}" for k, v in want.items() if have.get(k) != v]
    if diff:
        raise ValueError(f"pretrain: the resume checkpoint {path} was made for another run ({'; '.join(diff)}); "
                         f"set resume=false, or state_dir/run_dir to another folder, to start afresh")


def save_checkpoint(path: Path, model, opt, sampler: WindowSampler, st: LoopState, signature: dict,
                    tokenizer_json: str, mlflow_run_id: str | None) -> None:
    payload = {"signature": signature, "model": model.state_dict(), "optimizer": opt.state_dict(),
               "sampler": sampler.state_dict(), "loop": asdict(st), "tokenizer": tokenizer_json,
               "mlflow_run_id": mlflow_run_id, "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(buf.getvalue()))


def restore(ckpt: dict, model, opt, sampler: WindowSampler) -> LoopState:
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sampler.load_state_dict(ckpt["sampler"])
    return LoopState(**ckpt["loop"])


# -- the loop -----------------------------------------------------------------------------------------
class PretrainLoop:
    """One job's training: `run(deadline)` trains from `state.step` until max_steps or the deadline."""

    def __init__(self, cfg: PretrainConfig, model, opt, sampler: WindowSampler, val_tokens: torch.Tensor,
                 logger, device: torch.device, amp_dtype, state: LoopState, save):
        self.cfg, self.model, self.opt, self.sampler, self.logger = cfg, model, opt, sampler, logger
        self.device, self.amp_dtype, self.state, self.save = device, amp_dtype, state, save
        self.val_windows = eval_windows(val_tokens, cfg.seq_len, cfg.eval_tokens)
        self.eval_seconds = 0.0
        self.loss_fn = training_loss_fn(cfg, model, amp_dtype)

    def run_val(self, step: int) -> float:
        t = time.perf_counter()
        s, n = evaluate_nll(self.model, self.val_windows, self.cfg.batch_size, self.amp_dtype, self.device)
        loss, st = s / max(n, 1), self.state
        if loss < st.best_loss or not self.cfg.keep_best:
            st.best_loss, st.best_step = loss, step
            if self.cfg.keep_best:
                st.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self.logger.log({"eval/val_loss": loss, "eval/val_ppl": math.exp(min(loss, 50))}, step)
        self.eval_seconds += time.perf_counter() - t
        return loss

    def _log(self, step: int, loss_acc: torch.Tensor, acc_n: int, gnorm, lr: float, since: tuple) -> bool:
        """Logs the interval's metrics (the host reads the device here only); False on a non-finite loss."""
        loss = float(loss_acc) / acc_n
        if not math.isfinite(loss):
            self.state.stop_reason = f"non-finite loss by step {step}"
            log.error("training stopped: %s (the best val snapshot is shipped)", self.state.stop_reason)
            return False
        t_last, step_last = since
        tokens = (step - step_last) * self.cfg.batch_size * self.cfg.seq_len
        m = {"train/loss": loss, "train/lr": lr, "train/grad_norm": float(gnorm),
             "train/epoch": self.sampler.epochs_done, "train/tokens": float(step * self.cfg.batch_size *
                                                                             self.cfg.seq_len),
             "perf/tok_s": tokens / max(time.perf_counter() - t_last, 1e-9)}
        if self.cfg.tracking.system_metrics:
            from dflash.tracking.sysmetrics import system_metrics
            m.update(system_metrics())
        self.logger.log(m, step)
        return True

    def _step(self, lr: float):
        for gr in self.opt.param_groups:
            gr["lr"] = lr
        return train_step(self.model, self.opt, self.loss_fn, self.sampler.next(), self.cfg.grad_clip)

    def run(self, deadline: float) -> LoopState:
        cfg, st = self.cfg, self.state
        st.jobs += 1
        first_step, t0 = st.step, time.perf_counter()
        budget = max(deadline - t0, 1e-6)
        if cfg.eval_every and st.step == 0:  # the untrained model's val loss: the start of the curve
            self.run_val(0)
        loss_acc, acc_n, since = torch.zeros((), device=self.device), 0, (time.perf_counter(), st.step)
        st.stop_reason, lr = "max_steps", cfg.lr
        while st.step < cfg.max_steps:
            now = time.perf_counter()
            if now >= deadline:
                st.stop_reason = "time budget"
                break
            if cfg.job_max_steps and st.step - first_step >= cfg.job_max_steps:
                st.stop_reason = "job_max_steps"
                break
            frac = (now - t0) / budget if cfg.schedule_by_time and math.isfinite(deadline) else 0.0
            lr = lr_at(cfg, st.step, frac)
            loss, gnorm = self._step(lr)
            st.step += 1
            loss_acc += loss
            acc_n += 1
            if st.step % cfg.log_every == 0 or st.step == cfg.max_steps:
                if not self._log(st.step, loss_acc, acc_n, gnorm, lr, since):
                    break
                loss_acc.zero_()
                acc_n, since = 0, (time.perf_counter(), st.step)
            t_pause = time.perf_counter()  # eval and checkpoint time is not training time
            if cfg.eval_every and st.step % cfg.eval_every == 0:
                self.run_val(st.step)
            if cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0 and st.step < cfg.max_steps:
                t = time.perf_counter()
                self.save(replace(st, train_seconds=st.train_seconds + t - t0 - self.eval_seconds))
                self.eval_seconds += time.perf_counter() - t
            since = (since[0] + time.perf_counter() - t_pause, since[1])
        return self._end_job(first_step, t0)

    def _end_job(self, first_step: int, t0: float) -> LoopState:
        st = self.state
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0 - self.eval_seconds
        st.train_seconds += seconds
        st.history.append((st.jobs, first_step, st.step, seconds))
        if st.step > first_step and (st.best_step != st.step or not self.cfg.keep_best):
            self.run_val(st.step)
        self.save(st)
        return st
