"""DFlash 2's selector pieces, each before and after, side by side in one process (docs/dflash2.md, "Speed"):
`python benchmarks/gpu/selector_kernels.py [--iters 10] [--small]`.

At the two bench shapes (the reference target's: 131,072 positions, V = 4,096, the LM-head chunk 65,536 rows of
float32 logits; the 27B target's: 4,096 positions, V = 248,320, chunks of 1,024 rows of bf16 logits), with the
selector's rank 256 and top-16:
- the candidates' top-k of one LM-head chunk: torch.topk against `dflash.training.topk.top_k_rows`' two passes,
  their steps 2 and 3 by torch ops and by one Triton kernel (`topk.TRITON_SECOND_PASS`, `topk_triton`), its keys
  int64 and (16-bit logits, `topk_triton.NARROW_KEYS`) int32;
- the Triton LM-head chunk (hard labels, with its gradient) without a top-k, and with the top-16 by torch.topk, by
  `top_k_rows`' two passes, with the first pass made in the chunk's own row pass (`topk.FUSED_FIRST_PASS`), and with
  that and the Triton steps 2 and 3; only where Triton runs;
- the pair scores, forward and backward (the gradients to the gate and the codebook): the rows gathered whole
  (`F.embedding` then a batched product, what autograd saves) against `GatheredDots` (chunked forward, embedding-bag
  backward) and against its Triton kernels (`selector_triton`, where Triton runs);
- the pair scores with their gate pred[a] ⊙ h·P, forward and backward (the gradients to the bf16 projection and both
  codebooks): the gate a torch gather and product before the kernels against made in them (`selector.PairScores`,
  `selector.TRITON_FUSED_GATE`), where Triton runs;
- the injected gold tokens' logits (`selector_loss.gold_logits`): a float32 gather and product against one kernel;
- the unary scores' gradient (CandidateLogits' backward): the embedding bag against `selector_triton.weighted_rows`;
- the selector's hidden projection, forward and backward, in float32 against in bf16 (a bf16 head's dtype);
- the training metric's walk (`walk_candidates` over the blocks `selector_loss.WALK_BLOCKS` lets it follow): the
  torch loop against the one-launch kernel (`selector.TRITON_WALK`).
Prints one JSON line per figure and a table last, ms per call. Runs on the CPU too (`--small`: a smoke run).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from dflash.bench.flops import timed
from dflash.drafter import selector, selector_triton
from dflash.drafter.selector import GatheredDots
from dflash.training.topk import top_k_rows

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def timed_ms(fn, iters: int) -> float:
    """Mean ms a call after one warm-up call (`dflash.bench.flops.timed`)."""
    return timed(fn, iters, DEV, warmup=1) * 1e3


def gathered_whole(gate_Sr, table_Vr, idx_Sk):
    return torch.einsum("skr,sr->sk", F.embedding(idx_Sk, table_Vr), gate_Sr)


def pair_scores_case(S: int, V: int, k: int, r: int, iters: int) -> dict[str, float]:
    g = torch.Generator(device=DEV).manual_seed(0)
    gate = torch.randn(S, r, device=DEV, generator=g, requires_grad=True)
    table = torch.randn(V, r, device=DEV, generator=g, requires_grad=True)
    # Zipf-like ids: a few tokens are candidates at most positions, as a trained drafter's frequent tokens are
    ranks = torch.randint(1, V + 1, (S, k), device=DEV, generator=g).float()
    idx = (V / ranks).long().clamp_max(V - 1)
    w = torch.randn(S, k, device=DEV, generator=g)
    out = {}
    saved, saved_bytes = selector.TRITON_PAIR_SCORES, selector_triton.TABLE_COPIES_BYTES
    try:
        for name, fn, tri in (("whole", gathered_whole, False), ("gathered_dots", GatheredDots.apply, False),
                              ("triton_one_copy", GatheredDots.apply, True), ("triton", GatheredDots.apply, True)):
            if tri and not selector_triton.available(gate, table):
                continue
            selector.TRITON_PAIR_SCORES = tri
            selector_triton.TABLE_COPIES_BYTES = 0 if name == "triton_one_copy" else saved_bytes

            def step(fn=fn):
                gate.grad = table.grad = None
                (fn(gate, table, idx) * w).sum().backward()
            out[name] = timed_ms(step, iters)
            a = torch.autograd.grad((gathered_whole(gate, table, idx) * w).sum(), [gate, table])
            b = torch.autograd.grad((fn(gate, table, idx) * w).sum(), [gate, table])
            out[f"{name}_max_grad_diff"] = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
    finally:
        selector.TRITON_PAIR_SCORES, selector_triton.TABLE_COPIES_BYTES = saved, saved_bytes
    return out


def _zipf_ids(shape, V: int, g: torch.Generator) -> torch.Tensor:
    """Zipf-like ids: a few tokens are candidates (and predecessors) at most positions, as a trained drafter's
    frequent tokens are."""
    return (V / torch.randint(1, V + 1, shape, device=DEV, generator=g).float()).long().clamp_max(V - 1)


def gate_case(S: int, V: int, k: int, r: int, iters: int) -> dict[str, float]:
    """`CandidateSelector.pair_scores` with a bf16 projection (the training step's), forward and its three
    gradients: the gate pred[a] ⊙ proj a torch gather and product (`GatheredDots`' kernels after it) against made in
    the kernels (`PairScores`)."""
    if not DEV.type == "cuda" or not selector_triton.runs_on(torch.zeros(1, device=DEV)):
        return {}
    g = torch.Generator(device=DEV).manual_seed(0)
    sel = selector.CandidateSelector(8, V, r, k).to(DEV)
    proj = torch.randn(S, r, device=DEV, generator=g).bfloat16().requires_grad_()
    prev, cand = _zipf_ids((S,), V, g), _zipf_ids((S, k), V, g)
    w = torch.randn(S, k, device=DEV, generator=g)
    params = [proj, sel.predecessor_codebook, sel.successor_codebook]
    out, grads = {}, {}
    saved = selector.TRITON_FUSED_GATE
    try:
        for name, fused in (("product", False), ("fused", True)):
            selector.TRITON_FUSED_GATE = fused

            def step():
                for p in params:
                    p.grad = None
                (sel.pair_scores(None, prev, cand, proj) * w).sum().backward()
            out[name] = timed_ms(step, iters)
            grads[name] = torch.autograd.grad((sel.pair_scores(None, prev, cand, proj) * w).sum(), params)
    finally:
        selector.TRITON_FUSED_GATE = saved
    out["max_grad_diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                               for a, b in zip(grads["fused"], grads["product"]))
    return out


def gold_logits_case(S: int, H: int, V: int, iters: int) -> dict[str, float]:
    """`selector_loss.gold_logits` (each position's gold logit, no grad, bf16 head): the float32 gather and product
    against one `selector_triton.dots` launch (where Triton runs)."""
    from dflash.training import selector_loss
    g = torch.Generator(device=DEV).manual_seed(0)
    hidden = torch.randn(S, H, device=DEV, generator=g)
    head = (torch.randn(V, H, device=DEV, generator=g) * H ** -0.5).bfloat16()
    gold = _zipf_ids((S,), V, g)
    out = {}
    saved = selector_loss.TRITON_GOLD_LOGITS
    try:
        for name, kernel in (("torch", False), ("triton", True)):
            if kernel and not (DEV.type == "cuda" and selector_triton.runs_on(head)):
                continue
            selector_loss.TRITON_GOLD_LOGITS = kernel
            out[name] = timed_ms(lambda: selector_loss.gold_logits(hidden, head, gold), iters)
            out[f"{name}_values"] = selector_loss.gold_logits(hidden, head, gold)
    finally:
        selector_loss.TRITON_GOLD_LOGITS = saved
    if "triton_values" in out:
        a, b = out.pop("triton_values"), out["torch_values"]
        out["equal_frac"] = float((a == b).float().mean())
    out.pop("torch_values")
    return out


def walk_case(N: int, K: int, H: int, V: int, k: int, r: int, iters: int) -> dict[str, float]:
    """The training metric's self-conditioned walk (`walk_candidates`, no grad) over N blocks of K positions: K
    dependent steps of a few small kernels each, the `selector_streak` diagnostic's cost a step."""
    g = torch.Generator(device=DEV).manual_seed(0)
    sel = selector.CandidateSelector(H, V, r, k).to(DEV)
    hidden = torch.randn(N, K, H, device=DEV, generator=g).bfloat16()
    unary = torch.randn(N, K, k, device=DEV, generator=g)
    cand = torch.randint(0, V, (N, K, k), device=DEV, generator=g)
    anchor = torch.randint(0, V, (N,), device=DEV, generator=g)
    projected = sel.project(hidden).detach()
    out = {}
    saved = selector.TRITON_WALK
    try:
        for name, tri in (("torch", False), ("triton", True)):
            selector.TRITON_WALK = tri
            out[name] = timed_ms(lambda: sel.walk_candidates(hidden, unary, cand, anchor, projected_SKr=projected), iters)
            out[f"{name}_tokens"] = sel.walk_candidates(hidden, unary, cand, anchor, projected_SKr=projected).tokens
    finally:
        selector.TRITON_WALK = saved
    out["same_path"] = float(torch.equal(out.pop("torch_tokens"), out.pop("triton_tokens")))
    return out


def projection_case(S: int, H: int, r: int, iters: int) -> dict[str, float]:
    """The selector's hidden projection h · P, forward and both gradients: in float32 (P's dtype) against in bf16
    (`CandidateSelector.project(h, torch.bfloat16)`, a bf16 head's dtype)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    sel = selector.CandidateSelector(H, 64, r, 16).to(DEV)
    hidden = torch.randn(S, H, device=DEV, generator=g, requires_grad=True)
    w = torch.randn(S, r, device=DEV, generator=g)
    out = {}
    for name, dt in (("float32", None), ("bf16", torch.bfloat16)):
        def step(dt=dt):
            hidden.grad = sel.hidden_projection.weight.grad = None
            (sel.project(hidden, dt) * w).sum().backward()
        out[name] = timed_ms(step, iters)
    return out


def unary_grad_case(S: int, k: int, H: int, V: int, iters: int) -> dict[str, float]:
    """CandidateLogits' backward, Σ_j g_sj W[idx_sj] over the bf16 head: the embedding bag against
    `selector_triton.weighted_rows` (where Triton runs)."""
    from dflash.training.lm_head_loss import _sparse_product
    g = torch.Generator(device=DEV).manual_seed(0)
    head = torch.randn(V, H, device=DEV, generator=g).bfloat16()
    ranks = torch.randint(1, V + 1, (S, k), device=DEV, generator=g).float()
    idx = (V / ranks).long().clamp_max(V - 1)
    coef = torch.randn(S, k, device=DEV, generator=g).bfloat16()
    out = {"bag": timed_ms(lambda: _sparse_product(idx, coef, head, torch.float32), iters)}
    if selector_triton.runs_on(head) and head.is_cuda:
        out["triton"] = timed_ms(lambda: selector_triton.weighted_rows(idx, coef, head), iters)
    return out


def top_k_case(C: int, V: int, k: int, dtype: torch.dtype, iters: int) -> dict[str, float]:
    from dflash.training import topk
    x = torch.randn(C, V, device=DEV, dtype=dtype)
    out = {"torch": timed_ms(lambda: x.topk(k, dim=-1), iters)}
    from dflash.training import topk_triton
    saved = topk.TRITON_SECOND_PASS, topk_triton.NARROW_KEYS
    try:  # the Triton steps with int64 keys, then (16-bit rows of at most 65,536) with int32 keys
        for name, second, narrow in (("two_pass", False, True), ("two_pass_triton_int64", True, False),
                                     ("two_pass_triton", True, True)):
            topk.TRITON_SECOND_PASS, topk_triton.NARROW_KEYS = second, narrow
            out[name] = timed_ms(lambda: top_k_rows(x, k, grouped=True), iters)
            out[f"{name}_same_values"] = float(torch.equal(top_k_rows(x, k, grouped=True)[0], x.topk(k, dim=-1).values))
    finally:
        topk.TRITON_SECOND_PASS, topk_triton.NARROW_KEYS = saved
    return out


def lm_head_chunk_case(C: int, D: int, V: int, k: int, iters: int) -> dict[str, float]:
    """The Triton LM-head chunk (bf16 head, hard labels, with its gradient) without the top-k and with it taken each
    way: torch.topk, `top_k_rows`' two passes, the first pass made in the chunk's own row pass."""
    from dflash.training import lm_head_triton, topk
    if not lm_head_triton.triton_available(DEV):
        return {}
    g = torch.Generator(device=DEV).manual_seed(0)
    head = (torch.randn(V, D, device=DEV, generator=g) * D ** -0.5).bfloat16()
    hidden = torch.randn(C, D, device=DEV, generator=g)
    labels = torch.randint(0, V, (C,), device=DEV, generator=g)
    saved = topk.FUSED_FIRST_PASS, topk.GROUPED_MIN_VOCAB, topk.TRITON_SECOND_PASS

    def chunk(top_k, fused, min_vocab, second=False):
        topk.FUSED_FIRST_PASS, topk.GROUPED_MIN_VOCAB, topk.TRITON_SECOND_PASS = fused, min_vocab, second
        return lm_head_triton.hard_label_chunk(hidden, head, labels, need_grad=True, top_k=top_k)

    out = {}
    try:
        for name, args in (("no_topk", (0, False, 0)), ("torch", (k, False, V + 1)), ("two_pass", (k, False, 0)),
                           ("row_pass", (k, True, 0)), ("row_pass_triton", (k, True, 0, True))):
            out[name] = timed_ms(lambda args=args: chunk(*args), iters)
        want = chunk(k, False, V + 1)[0]["top_k_val"]
        out["same_values"] = float(torch.equal(chunk(k, True, 0)[0]["top_k_val"], want)
                                   and torch.equal(chunk(k, True, 0, True)[0]["top_k_val"], want))
    finally:
        topk.FUSED_FIRST_PASS, topk.GROUPED_MIN_VOCAB, topk.TRITON_SECOND_PASS = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke run)")
    a = ap.parse_args()
    div = 64 if a.small else 1
    cases = [("top-k, reference chunk (65,536 x 4,096 float32)", top_k_case(65536 // div, 4096, 16, torch.float32, a.iters)),
             ("top-k, reference chunk (65,536 x 4,096 bf16)", top_k_case(65536 // div, 4096, 16, torch.bfloat16, a.iters)),
             ("top-k, 27B chunk (1,024 x 248,320 bf16)", top_k_case(1024 // div, 248320, 16, torch.bfloat16, a.iters)),
             ("pair scores fwd+bwd, reference (131,072 x 16, V 4,096)", pair_scores_case(131072 // div, 4096, 16, 256, a.iters)),
             ("pair scores fwd+bwd, 27B (4,096 x 16, V 248,320)", pair_scores_case(4096 // div, 248320, 16, 256, a.iters))]
    grads = [("unary-score gradient, reference (131,072 x 16, H 384)", unary_grad_case(131072 // div, 16, 384, 4096, a.iters)),
             ("unary-score gradient, 27B (4,096 x 16, H 5,120)", unary_grad_case(4096 // div, 16, 5120, 248320, a.iters))]
    projections = [("hidden projection fwd+bwd, reference (131,072 x 384 -> 256)", projection_case(131072 // div, 384, 256, a.iters)),
                   ("hidden projection fwd+bwd, 27B (4,096 x 5,120 -> 256)", projection_case(4096 // div, 5120, 256, a.iters))]
    gates = [("pair scores + gate fwd+bwd, reference (131,072 x 16, V 4,096)", gate_case(131072 // div, 4096, 16, 256, a.iters)),
             ("pair scores + gate fwd+bwd, 27B (4,096 x 16, V 248,320)", gate_case(4096 // div, 248320, 16, 256, a.iters))]
    golds = [("gold logits, reference (131,072 x 384, V 4,096)", gold_logits_case(131072 // div, 384, 4096, a.iters)),
             ("gold logits, 27B (4,096 x 5,120, V 248,320)", gold_logits_case(4096 // div, 5120, 248320, a.iters))]
    walks = [("walk metric, reference (1,024 blocks x 16, V 4,096)", walk_case(1024 // div, 16, 384, 4096, 16, 256, a.iters)),
             ("walk metric, 27B (256 blocks x 16, V 248,320)", walk_case(256 // div, 16, 5120, 248320, 16, 256, a.iters))]
    chunks = [("LM-head chunk, reference (65,536 x 384, V 4,096)", lm_head_chunk_case(65536 // div, 384, 4096, 16, a.iters)),
              ("LM-head chunk, 27B (1,024 x 5,120, V 248,320)", lm_head_chunk_case(1024 // div, 5120, 248320, 16, a.iters))]
    for name, fig in cases + gates + golds + grads + projections + walks + chunks:
        print(json.dumps({"case": name, "device": str(DEV), **fig}))
    if all(fig for _, fig in chunks):
        print(f"\n{'Triton LM-head chunk + top-16, ms':58s} {'no top-k':>9s} {'torch':>9s} {'2-pass':>9s} {'row pass':>9s}"
              f" {'+ Triton 2-3':>13s}")
        for name, fig in chunks:
            print(f"{name:58s} {fig['no_topk']:9.2f} {fig['torch']:9.2f} {fig['two_pass']:9.2f} {fig['row_pass']:9.2f}"
                  f" {fig['row_pass_triton']:13.2f}")
    print(f"\n{'case':58s} {'before ms':>10s} {'after ms':>10s} {'ratio':>7s}")
    for name, fig in cases:
        before, after = (fig["torch"], fig["two_pass"]) if "torch" in fig else (fig["whole"], fig["gathered_dots"])
        print(f"{name:58s} {before:10.2f} {after:10.2f} {before / after:6.2f}x")
        if "triton" in fig:
            print(f"{'  the same, Triton kernels (selector_triton) against the torch bag':58s} {after:10.2f} "
                  f"{fig['triton']:10.2f} {after / fig['triton']:6.2f}x")
            print(f"{'  Triton, the table gradient in one copy / in copies':58s} {fig['triton_one_copy']:10.2f} "
                  f"{fig['triton']:10.2f} {fig['triton_one_copy'] / fig['triton']:6.2f}x")
        if "two_pass_triton" in fig:
            print(f"{'  the same, steps 2 and 3 in one Triton kernel':58s} {after:10.2f} {fig['two_pass_triton']:10.2f} "
                  f"{after / fig['two_pass_triton']:6.2f}x")
            print(f"{'  that kernel, int64 keys / int32 where they fit':58s} {fig['two_pass_triton_int64']:10.2f} "
                  f"{fig['two_pass_triton']:10.2f} {fig['two_pass_triton_int64'] / fig['two_pass_triton']:6.2f}x")
    for name, fig in gates:
        if fig:
            print(f"{name + ', product / in kernels':58s} {fig['product']:10.2f} {fig['fused']:10.2f} "
                  f"{fig['product'] / fig['fused']:6.2f}x")
    for name, fig in golds:
        if "triton" in fig:
            print(f"{name + ', torch / one kernel':58s} {fig['torch']:10.2f} {fig['triton']:10.2f} "
                  f"{fig['torch'] / fig['triton']:6.2f}x")
    for name, fig in grads:
        if "triton" in fig:
            print(f"{name:58s} {fig['bag']:10.2f} {fig['triton']:10.2f} {fig['bag'] / fig['triton']:6.2f}x")
    for name, fig in projections:
        print(f"{name + ', fp32 / bf16':58s} {fig['float32']:10.2f} {fig['bf16']:10.2f} {fig['float32'] / fig['bf16']:6.2f}x")
    for name, fig in walks:
        print(f"{name + ', torch loop / one launch':58s} {fig['torch']:10.2f} {fig['triton']:10.2f} "
              f"{fig['torch'] / fig['triton']:6.2f}x")


if __name__ == "__main__":
    main()
