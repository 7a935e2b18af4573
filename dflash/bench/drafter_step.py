"""The drafter side alone: full training steps (forward, chunked LM-head loss, backward, fused AdamW) on
synthetic features of the production shape, with a CUDA-event phase breakdown and a kernel-family profile."""
from __future__ import annotations

import torch

from dflash.bench.flops import count_flops, timed
from dflash.bench.profiling import profile_kernels
from dflash.config import RunConfig
from dflash.target.model import Target
from dflash.training.losses import build_loss, compute_position_stats


class DrafterStepBench:
    """One trainer-shaped drafter step on synthetic features, with a CUDA-event phase breakdown."""

    def __init__(self, cfg: RunConfig, target: Target, b: BenchConfig):
        from dflash.drafter.model import build_drafter
        from dflash.training.compiling import compile_drafter
        self.cfg, self.b, self.device = cfg, b, target.device
        t = target
        self.drafter = build_drafter(cfg.drafter, t.hidden_size, t.info.num_layers, t.mask_token_id,
                                     t.layer_ids).to(t.device)
        self.drafter.attach_target_head(t.embed_weight(), t.lm_head_weight())
        self.model = compile_drafter(self.drafter, cfg.trainer.compile_mode) if cfg.trainer.compile else self.drafter
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=1e-4, fused=t.device.type == "cuda")
        self.loss_fn = build_loss(cfg.loss)
        bs, T, B = cfg.drafter.block_size, b.seq_len, b.drafter_batch
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.features = torch.randn(B, T, len(t.layer_ids), t.hidden_size, dtype=t.dtype, device=t.device)
        n = min(b.anchors, T - bs + 1)
        self.anchors = torch.stack([torch.randperm(T - bs + 1, generator=gen)[:n].sort().values + 1
                                    for _ in range(B)]).to(t.device)
        self.anchor_tokens = torch.randint(0, t.vocab_size - 1, (B, n), device=t.device)
        self.labels = torch.randint(0, t.vocab_size - 1, (B * n, bs - 1), device=t.device)
        self.phases: dict[str, float] = {}

    def useful_flops(self) -> int:
        """FLOPs of one step counted on its eager SDPA twin, before anything is compiled: the attention kernel
        and compilation change how the work runs, not how much of it is useful (masked-out keys are not counted
        either way), and a counting dispatch mode must not meet compiled code (it breaks FlexAttention's trace
        and sends dynamo back to eager)."""
        from dflash.drafter.attention import attention_kernel
        saved = self.model, self.drafter.attn_kernel
        self.model, self.drafter.attn_kernel = self.drafter, attention_kernel("sdpa")
        try:
            return count_flops(self.step)
        finally:
            self.model, self.drafter.attn_kernel = saved

    def step(self, timed: bool = False) -> None:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if timed else None
        mark = (lambda i: ev[i].record()) if timed else (lambda i: None)  # noqa: E731
        mark(0)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            hidden = self.model(self.features, self.anchors, self.anchor_tokens)
        mark(1)
        B, N, K, H = hidden.shape
        stats = compute_position_stats(hidden.reshape(B * N, K, H), self.drafter.lm_head_VH, self.labels,
                                       chunk_size=self.cfg.loss.chunk_size, lm_head_grad=self.cfg.loss.lm_head_grad)
        loss = self.loss_fn(stats, self.labels != -100)
        mark(2)
        loss.backward()
        mark(3)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mark(4)
        if timed:
            torch.cuda.synchronize()
            names = ["drafter_forward", "lm_head_loss", "backward", "optimizer"]
            for i, name in enumerate(names):
                self.phases[name] = self.phases.get(name, 0.0) + ev[i].elapsed_time(ev[i + 1]) / 1e3

    def run(self) -> dict:
        flops = self.useful_flops()
        for _ in range(self.b.warmup):
            self.step()
        sec = timed(self.step, self.b.iters, self.device)
        if self.device.type == "cuda":
            self.phases = {}
            for _ in range(3):
                self.step(timed=True)
            self.phases = {k: v / 3 for k, v in self.phases.items()}
        data_tokens = self.b.drafter_batch * self.b.seq_len
        out = {"tok_s": data_tokens / sec, "flops_per_tok": flops / data_tokens, "sec_per_step": sec,
               "phases": self.phases}
        if self.device.type == "cuda" and self.b.kernel_profile:
            out["kernels"] = profile_kernels(self.step)
        return out
