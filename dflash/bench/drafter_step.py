"""The drafter side alone: the trainer's own step (`Trainer.step`: forward, the loss with its LM-head
statistics, backward, gradient clipping, fused AdamW, LR schedule) on synthetic features of the production
shape, with a CUDA-event phase breakdown and a kernel-family profile."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dflash.bench.config import BenchConfig
from dflash.bench.flops import count_flops, dflash2_elementwise_flops, timed
from dflash.bench.profiling import profile_kernels
from dflash.config import RunConfig
from dflash.target.model import Target
from dflash.training.batching import DrafterBatch

PHASES = ("drafter_forward", "lm_head_loss", "backward", "optimizer")


class PhaseEvents:
    """CUDA events at the step's phase boundaries, through public hooks only: the step's start (recorded by the
    caller), the drafter forward's end (a forward hook on the trained module), the loss's end (the trainer's
    loss wrapped), the optimizer's start and end (its step hooks). Backward includes gradient clipping."""

    def __init__(self, trainer, event=lambda: torch.cuda.Event(enable_timing=True), sync=torch.cuda.synchronize):
        self.trainer, self.times = trainer, {p: 0.0 for p in PHASES}
        self.event, self.sync = event, sync  # a CPU test passes host-clock stand-ins
        self.events: list = []
        self.loss_fn = trainer.loss_fn

    def mark(self, *_args, **_kwargs) -> None:
        self.events.append(self.event())
        self.events[-1].record()

    def timed_loss(self, *args, **kwargs):
        out = self.loss_fn(*args, **kwargs)
        self.mark()
        return out

    def __enter__(self):
        t = self.trainer
        self.handles = [t.train_model.register_forward_hook(self.mark), t.opt.register_step_pre_hook(self.mark),
                        t.opt.register_step_post_hook(self.mark)]
        t.loss_fn = self.timed_loss
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.trainer.loss_fn = self.loss_fn

    def add(self) -> None:
        """After one step that started with `mark()`: five events, four phases."""
        self.sync()
        ev, self.events = self.events, []
        if len(ev) != len(PHASES) + 1:
            raise RuntimeError(f"drafter step phases: {len(ev)} boundary events, expected {len(PHASES) + 1}")
        for i, name in enumerate(PHASES):
            self.times[name] += ev[i].elapsed_time(ev[i + 1]) / 1e3


class DrafterStepBench:
    """The trainer's step on one fixed synthetic batch (features, anchors and labels of the bench's shape)."""

    def __init__(self, cfg: RunConfig, target: Target, b: BenchConfig):
        from dflash.app.run import TrainingRun
        self.b, self.device = b, target.device
        # max_epochs=0: this times one fixed batch, so no epoch guard (it warned "MEMORIZATION RISK" in every
        # bench run: 8 sequences for the run's max_steps)
        run_cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, source="synthetic", min_len=b.seq_len, max_len=b.seq_len,
                                          num_sequences=8, max_epochs=0),
            trainer=dataclasses.replace(cfg.trainer, num_anchors=b.anchors, warmup_steps=1, online_data=False),
            tracking=dataclasses.replace(cfg.tracking, enabled=False, console=False))
        self.trainer = TrainingRun(run_cfg, target=target).trainer
        self.name = Path(cfg.run_dir).name if cfg.run_dir else "drafter"  # the bench's drafter / drafter_variant<i>
        soft_k = target.cfg.soft_top_k if self.trainer.loss_fn.needs_soft else 0
        self.batch = synthetic_batch(target, cfg.drafter.block_size, b, soft_k)

    def step(self) -> None:
        self.trainer.step(self.batch)

    def useful_flops(self) -> int:
        """FLOPs of one step counted on its eager SDPA twin, before anything is compiled: the attention kernel
        and compilation change how the work runs, not how much of it is useful (masked-out keys are not counted
        either way), and a counting dispatch mode must not meet compiled code (it breaks FlexAttention's trace
        and sends dynamo back to eager)."""
        from dflash.drafter.attention import attention_kernel
        t = self.trainer
        saved = t.train_model, t.drafter.attn_kernel
        t.train_model, t.drafter.attn_kernel = t.drafter, attention_kernel("sdpa")
        try:  # + DFlash 2's convolutions and selector scores, elementwise work the counter does not see
            blocks = int(self.batch.anchors_BN.numel())
            return count_flops(self.step) + dflash2_elementwise_flops(t.cfg.drafter, t.drafter.hidden_size, blocks)
        finally:
            t.train_model, t.drafter.attn_kernel = saved

    def phases(self, steps: int = 3, **events) -> dict[str, float]:
        with PhaseEvents(self.trainer, **events) as ev:
            for _ in range(steps):
                ev.mark()
                self.step()
                ev.add()
        return {k: v / steps for k, v in ev.times.items()}

    def run(self) -> dict:
        cuda = self.device.type == "cuda"
        if cuda:  # this drafter's own peak (the target's resident weights included), apart from other variants'
            torch.cuda.reset_peak_memory_stats(self.device)
        flops = self.useful_flops()
        sec = timed(self.step, self.b.iters, self.device, warmup=self.b.warmup)
        data_tokens = self.b.drafter_batch * self.b.seq_len
        out = {"tok_s": data_tokens / sec, "flops_per_tok": flops / data_tokens, "sec_per_step": sec, "phases": {}}
        if cuda:
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        try:  # a breakdown that fails (a hook a compiled module refuses) must not cost the step's figure
            out["phases"] = self.phases() if cuda else {}
        except Exception as e:  # noqa: BLE001
            out["phases_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if cuda and self.b.kernel_profile:
            trace = str(Path(self.b.kernel_trace) / f"{self.name}.json") if self.b.kernel_trace else None
            out["kernels"] = profile_kernels(self.step, top=self.b.kernel_top, trace=trace)  # DFlash 2: many small ones
        return out


def synthetic_batch(target: Target, block_size: int, b: BenchConfig, soft_k: int = 0) -> DrafterBatch:
    """`drafter_batch` sequences of `seq_len` random features with `anchors` sorted random anchors each (and
    top-`soft_k` soft labels for the losses that read them)."""
    t, bs, T, B = target, block_size, b.seq_len, b.drafter_batch
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = min(b.anchors, T - bs + 1)
    anchors = torch.stack([torch.randperm(T - bs + 1, generator=gen)[:n].sort().values + 1 for _ in range(B)])
    soft = (None, None)
    if soft_k:
        vals = torch.randn(B, n, bs - 1, soft_k, device=t.device).sort(dim=-1, descending=True).values
        soft = (vals, torch.randint(0, t.vocab_size - 1, (B, n, bs - 1, soft_k), device=t.device))
    return DrafterBatch(
        features_BTLH=torch.randn(B, T, len(t.layer_ids), t.hidden_size, dtype=t.dtype, device=t.device),
        anchors_BN=anchors.to(t.device), anchor_tokens_BN=torch.randint(0, t.vocab_size - 1, (B, n), device=t.device),
        labels_BNK=torch.randint(0, t.vocab_size - 1, (B, n, bs - 1), device=t.device),
        soft_vals_BNKk=soft[0], soft_idx_BNKk=soft[1], num_tokens=B * T)
