"""DFlash 2's convolution around one sublayer, each way, side by side in one process (docs/dflash2.md, "Speed"):
`python benchmarks/gpu/conv_kernels.py [--iters 20] [--small]`.

The stand-in is what `DrafterLayer._around` does around each sublayer, with a Linear for the sublayer, compiled as the
trainer compiles the drafter, under bf16 autocast with float32 parameters and a float32 residual stream (the
drafter's own dtypes): finish(W · prepare(norm(h)), h), forward and backward. At the two bench shapes (reference:
8,192 blocks of 16 positions x 384 channels; 27B: 256 blocks x 5,120), K = 2 taps, groups of 16, it times the step
with the convolution as torch ops (`conv.TRITON_CONV` off: Inductor's kernels) and as `conv_triton`'s two kernels,
lists each way's kernel families and costliest kernels (the bench's profile, ms a step), and prints the
convolution's floor: the bytes its two applications move as passes of their own (`floor_bytes`), at the bandwidth
of a device copy measured here. `--tiles` also times the
kernels alone for each tile shape and warp count. Prints one JSON line per figure and a table last. Runs on the CPU
too (`--small`: a smoke run of the torch ops, eager).
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from dflash.bench.flops import timed
from dflash.bench.profiling import profile_kernels
from dflash.drafter import conv
from dflash.drafter.model import RMSNorm

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class AroundLinear(nn.Module):
    """conv.finish(W · conv.prepare(norm(h)), stream h): one of a DFlash 2 layer's two sublayers, a Linear in place of
    attention or the MLP."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.norm = RMSNorm(hidden, 1e-6)
        self.conv = conv.GroupedDynamicCausalConv(hidden, kernel_size, group_size)
        self.linear = nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():  # away from the identity start
            self.conv.base_kernel.normal_()
            self.conv.kernel_projection.weight.normal_(std=0.05)

    def forward(self, h_SbH: torch.Tensor) -> torch.Tensor:
        prepared, dyn = self.conv.prepare(self.norm(h_SbH))
        return self.conv.finish(self.linear(prepared), dyn, h_SbH)


def copy_bandwidth() -> float:
    """Bytes a second of a device-to-device copy of 1 GiB (read + write)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=DEV)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), 10, DEV, warmup=2)
    return 2 * src.numel() * 4 / s


def floor_bytes(S: int, bs: int, H: int, K: int, G: int) -> int:
    """The convolution's own reads and writes a step, as two separate passes each way: `prepare` reads the float32
    normed input and writes bf16 (autocast's dtype); its backward reads the bf16 gradient and the input and writes the
    float32 gradient. `finish` reads the sublayer's bf16 output and the float32 stream and writes the float32 sum; its
    backward reads the float32 gradient and the output and writes the bf16 gradient (the stream's gradient is the
    output's). Each reads its K dynamic values a position and group (bf16) and writes their gradient."""
    T, d = S * bs, S * bs * K * (H // G) * 2
    prepare = T * H * (4 + 2) + d + T * H * (2 + 4 + 4) + 2 * d
    finish = T * H * (2 + 4 + 4) + d + T * H * (4 + 2 + 2) + 2 * d
    return prepare + finish


def case(name: str, S: int, bs: int, H: int, iters: int, compile_: bool) -> dict:
    torch.manual_seed(0)
    model = AroundLinear(H, 2, 16).to(DEV)
    h = torch.randn(S, bs, H, device=DEV)
    w = torch.randn(S, bs, H, device=DEV)
    res: dict = {"case": name, "positions": S * bs, "hidden": H}
    outs = {}
    saved = conv.TRITON_CONV
    ways = [("torch ops", False)] + ([("Triton", True)] if DEV.type == "cuda" else [])
    try:
        for way, tri in ways:
            conv.TRITON_CONV = tri
            torch._dynamo.reset()
            fwd = torch.compile(model) if compile_ else model
            x = h.clone().requires_grad_()

            def step():
                model.zero_grad(set_to_none=True)
                x.grad = None
                with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=DEV.type == "cuda"):
                    out = fwd(x)
                (out * w).sum().backward()
                return out

            out = step()
            outs[way] = (out.detach().float(), x.grad.float(), model.conv.base_kernel.grad.clone(),
                         model.conv.kernel_projection.weight.grad.float().clone())
            res[f"{way} ms"] = timed(step, iters, DEV, warmup=2) * 1e3
            if DEV.type == "cuda":
                kernels = profile_kernels(step, steps=3, top=12)  # the bench's kernel families and costliest kernels
                res[f"{way} kernels"] = kernels
                res[f"{way} non-GEMM ms"] = round(sum(ms for fam, ms in kernels["ms_per_step"].items()
                                                      if fam != "gemm"), 4)
    finally:
        conv.TRITON_CONV = saved
    if len(outs) == 2:
        a, b = outs["torch ops"], outs["Triton"]
        res["max rel diff (out, grad x, grad base, grad proj)"] = [
            round(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item(), 6) for p, q in zip(b, a)]
    res["floor MB"] = floor_bytes(S, bs, H, 2, 16) / 1e6
    return res


def tile_sweep(S: int, bs: int, H: int, iters: int) -> list[dict]:
    """`conv_triton`'s two kernels alone (the float32-input `prepare` and the bf16-input `finish` with its float32
    stream), ms a call, for each tile shape (ROWS positions x CHANNELS channels) and warp count."""
    from dflash.drafter import conv_triton
    g = torch.Generator(device=DEV).manual_seed(0)
    x32 = torch.randn(S, bs, H, device=DEV, generator=g)
    y16 = x32.bfloat16()
    dyn = (torch.randn(S, bs, 2, 2, H // 16, device=DEV, generator=g) * 0.05).bfloat16()
    base = torch.randn(2, H, device=DEV, generator=g)
    g16, g32 = y16.clone(), x32.clone()
    saved = conv_triton.ROWS, conv_triton.CHANNELS, conv_triton.WARPS
    rows = []
    try:
        for R in (16, 32, 64):
            for C in (64, 128, 256):
                for W in (4, 8):
                    conv_triton.ROWS, conv_triton.CHANNELS, conv_triton.WARPS = R, C, W
                    op, bw = conv_triton.dynamic_conv, conv_triton.dynamic_conv_backward
                    r = {"rows": R, "channels": C, "warps": W, "fwd prepare": timed(
                        lambda: op(x32, dyn, 0, base, 16, None, torch.bfloat16), iters, DEV, warmup=2) * 1e3,
                        "fwd finish": timed(lambda: op(y16, dyn, 1, base, 16, x32, None), iters, DEV, warmup=2) * 1e3,
                        "bwd prepare": timed(lambda: bw(g16, x32, dyn, 0, base, 16), iters, DEV, warmup=2) * 1e3,
                        "bwd finish": timed(lambda: bw(g32, y16, dyn, 1, base, 16), iters, DEV, warmup=2) * 1e3}
                    r["sum"] = r["fwd prepare"] + r["fwd finish"] + r["bwd prepare"] + r["bwd finish"]
                    rows.append(r)
    finally:
        conv_triton.ROWS, conv_triton.CHANNELS, conv_triton.WARPS = saved
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--tiles", action="store_true", help="also time the Triton kernels alone for each tile shape")
    args = ap.parse_args(argv)
    shapes = [("tiny", 8, 16, 64)] if args.small else [("reference", 8192, 16, 384), ("27B", 256, 16, 5120)]
    bw = copy_bandwidth() if DEV.type == "cuda" else None
    rows = []
    for name, S, bs, H in shapes:
        r = case(name, S, bs, H, args.iters, compile_=DEV.type == "cuda")
        if bw:
            r["floor ms"] = r["floor MB"] * 1e6 / bw * 1e3
            r["copy GB/s"] = bw / 1e9
        print(json.dumps(r), flush=True)
        rows.append(r)
    if args.tiles and DEV.type == "cuda":
        for name, S, bs, H in shapes:
            sweep = tile_sweep(S, bs, H, args.iters)
            for r in sweep:
                print(json.dumps({"tiles": name, **r}), flush=True)
            best = min(sweep, key=lambda r: r["sum"])
            print(f"{name}: best tile {best}", flush=True)
    print("\n| shapes | step, torch ops (ms) | step, Triton (ms) | kernels but the GEMMs, torch ops / Triton (ms) "
          "| conv floor (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['torch ops ms']:.3f} | {r.get('Triton ms', float('nan')):.3f} | "
              f"{r.get('torch ops non-GEMM ms', float('nan'))} / {r.get('Triton non-GEMM ms', float('nan'))} | "
              f"{r.get('floor ms', float('nan')):.3f} |")


if __name__ == "__main__":
    main()
