"""The bench's printed table: one row builder per section, the pipeline's headline first among its rows."""
from __future__ import annotations


def _sides(out: dict) -> list[tuple[str, str, str]]:
    rows = []
    if "peak_flops" in out:
        rows.append(("matmul peak", f"{out['peak_flops'] / 1e12:.0f} TFLOP/s", "measured"))
    for side in ("target", "drafter"):
        if side in out:
            s = out[side]
            rows.append((f"{side} tok/s", f"{s['tok_s']:,.0f}",
                         f"{s['flops_per_tok'] / 1e9:.1f} GFLOP/tok, MFU {s.get('mfu', 0):.0%}{_peak(s)}"))
    base = out.get("target", {}).get("tok_s", 0.0)
    for label, s in out.get("target_variants", {}).items():
        if "error" in s:
            rows.append((f"target tok/s [{label}]", "failed", s["error"]))
            continue
        rows.append((f"target tok/s [{label}]", f"{s['tok_s']:,.0f}",
                     (f"the default is {base / s['tok_s']:.2f}x this; " if s["tok_s"] else "")
                     + f"{s['sec_per_call'] * 1e3:.1f} ms per call, MFU {s.get('mfu', 0):.0%}"))
    if "target_torch" in out:
        s, fast = out["target_torch"], out.get("target", {}).get("tok_s", 0.0)
        rows.append(("target tok/s, torch GDN", f"{s['tok_s']:,.0f}",
                     f"fast path is {fast / s['tok_s']:.2f}x" if s["tok_s"] else ""))
    return rows


def _peak(s: dict) -> str:
    """A drafter step's own peak GPU memory (DrafterStepBench), where it was measured."""
    return f", peak {s['peak_mem_gb']:.1f} GiB" if "peak_mem_gb" in s else ""


def _drafter_variants(out: dict) -> list[tuple[str, str, str]]:
    rows, base = [], out.get("drafter", {}).get("tok_s", 0.0)
    for label, s in out.get("drafter_variants", {}).items():
        if "error" in s:
            rows.append((f"drafter tok/s [{label}]", "failed", s["error"]))
            continue
        ratio = f"{s['tok_s'] / base:.2f}x the default, " if base else ""
        rows.append((f"drafter tok/s [{label}]", f"{s['tok_s']:,.0f}",
                     f"{ratio}{s['sec_per_step'] * 1e3:.1f} ms/step, MFU {s.get('mfu', 0):.0%}{_peak(s)}"))
    if "back_to_back_tok_s" in out:
        rows.append(("back-to-back tok/s", f"{out['back_to_back_tok_s']:,.0f}",
                     f"MFU {out.get('back_to_back_mfu', 0):.0%} (serial sum of the two sides)"))
    return rows


def pipeline_row(name: str, p: dict, out: dict, base: float = 0.0) -> tuple[str, str, str]:
    """Tokens trained on per second (the headline), its spread over the windows, then the rest; the
    stock-credited figure (tokens the producer put into the buffer) last and labelled as such."""
    if "error" in p:
        return name, "failed", p["error"]
    ratio = f"{p['consumed_tok_s'] / base:.2f}x the default; " if base else ""
    mfu = "n/a" if "mfu" not in p else format(p["mfu"], ".0%")
    serial = (f"{p['of_serial_sum']:.3f} of its serial sum {p['serial_sum_tok_s']:,.0f}; " if "of_serial_sum" in p
              else "")
    return (name, f"{p['consumed_tok_s']:,.0f}",
            f"{ratio}{serial}trained-on, {p['measured_steps']} steps in {p['repeats']} windows, spread "
            f"{p['spread']:.1%}; trainer's perf/consumed_tok_s {p['perf/consumed_tok_s']:,.0f}; "
            f"{out.get('gpus', 1)} device(s), {p.get('tok_s_per_gpu', 0):,.0f} each, MFU {mfu}; "
            f"consumer waits {p.get('perf/consumer_wait_frac', 0):.0%}; producer batch {p.get('producer_batch', 1)}, "
            f"{p.get('producer_mode', '?')}, {p.get('producer_stream', 'default')} stream; "
            f"stock-credited {p.get('stock_credited_tok_s', 0):,.0f}")


def _pipelines(out: dict) -> list[tuple[str, str, str]]:
    rows = []
    if "pipeline" in out:
        p = out["pipeline"]
        rows.append(pipeline_row("pipeline tok/s", p, out))
        if "host_syncs_per_step" in p:
            rows.append(("host syncs in step", (f"{p['host_syncs_per_step']:.2f}/step, "
                                                f"{p.get('host_reads_per_step', 0):.2f} host reads/step"),
                         f"profiler trace; {p.get('sync_calls') or 'none'}; at {p.get('sync_sites') or '-'}"))
    base = out.get("pipeline", {}).get("consumed_tok_s", 0.0)
    for label, p in out.get("pipeline_variants", {}).items():
        rows.append(pipeline_row(f"pipeline tok/s [{label}]", p, out, base))
    return rows


def _breakdowns(out: dict) -> list[tuple[str, str, str]]:
    rows = []
    for label, d in [("", out.get("drafter", {}))] + list(out.get("drafter_variants", {}).items()):
        if d.get("phases"):  # the default's row keeps its name; a variant's phases say what changed
            ph = d["phases"]
            total = sum(ph.values()) or 1
            rows.append(("drafter step" + (f" [{label}]" if label else ""),
                         " | ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ph.items()),
                         " | ".join(f"{v / total:.0%}" for v in ph.values())))
    for side, what in (("target", "ms per forward"), ("drafter", "ms/step")):
        for label, d in [("default", out.get(side, {}))] + list(out.get(f"{side}_variants", {}).items()):
            if d.get("kernels"):
                fams = d["kernels"]["ms_per_step"]
                rows.append((f"{side} kernels [{label}]", " | ".join(f"{k} {v:.1f}" for k, v in fams.items()),
                             f"{what} of GPU time by kernel family"))
    if "peak_mem_gb" in out:
        rows.append(("peak GPU memory", f"{out['peak_mem_gb']:.1f} GiB", ""))
    if "target_released_gb" in out:
        rows.append(("target layers released", f"{out['target_released_gb']:.1f} GiB",
                     "no section ran the target: the peaks above leave its decoder layers out (one GPU that trains "
                     "holds them too)"))
    return rows


def format_table(out: dict) -> str:
    from dflash.bench.serving_speed import serving_table
    sh = out.get("shapes", {})
    rows = [("device", out["device"], ""), ("kernels", str(out["kernels"]), ""),
            ("shapes", f"target {sh.get('target')}, drafter {sh.get('drafter')}",
             f"seq_len {sh.get('seq_len')}, anchors {sh.get('anchors')}, {sh.get('gpus')} GPU(s)")]
    rows += _sides(out) + _drafter_variants(out) + _pipelines(out) + _breakdowns(out)
    w = max(len(r[0]) for r in rows)
    text = "\n".join(f"{a:<{w}}  {b}  {c}" for a, b, c in rows)
    return text + ("\n\n" + serving_table(out["serving"]) if "serving" in out else "")
