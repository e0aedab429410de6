"""The one-GPU kernel passages (``moe_kernel``: TF/s, the one-token call) and the forecast
(``moe_forecast``); the layer from the router's output is ``fused_layer``'s."""
from __future__ import annotations

import pandas as pd

from ...analysis.moe import geometric_mean
from .. import Prose, count, plural, rec, span, val
from .common import cell_name


def kernel(kernel_records) -> Prose:
    """The fused kernel on one GPU (``moe_kernel``): its TF/s against cuBLAS dense per precision,
    the weakest cell, and the whole call against the unfused path."""
    out = []
    for r in kernel_records:
        t = r.table
        kernel_name = r.params.get("kernel", "?")
        parts = []
        for p, g in t.groupby("precision", sort=True):
            worst = g.loc[g["ratio_to_cublas"].idxmin()]
            wave = geometric_mean(g["ratio_to_cublas"])
            interleaved = geometric_mean(g["ratio_to_cublas_interleaved"])
            parts.append(f"in {p} the kernel alone (Expert-Wave) reaches a geometric mean of "
                         f"**{val(wave, '.3f')}** of cuBLAS dense TF/s "
                         f"over {count(len(g))} cells ({span(g['tflops'], '.0f')} TF/s), the "
                         f"lowest {val(worst['ratio_to_cublas'], '.3f')} for {cell_name(worst)}, and "
                         f"Interleaved {val(interleaved, '.3f')}")
        faster = int((t["call_wave_us"] < t["unfused_us"]).sum())
        text = (f"On {r.platform} (record {rec(r)}, the `{kernel_name}` kernel, one rank of "
                f"EP = {int(t['ep'].iloc[0])}): {'; '.join(parts)}. The whole fused call is "
                f"faster than torch's grouped GEMMs + SwiGLU + Combine in {count(faster)} of "
                f"{count(len(t))} cells ({span(t['fused_vs_unfused'], '.2f')}× its time). "
                f"Building a batch's schedule and checked launch on the host takes "
                f"{span(t['host_prepare_us'] / 1e3, '.1f')} ms per batch, outside these times.")
        out.append(text)
    return Prose(*out)


def call_overhead(kernel_records) -> Prose:
    """Where a one-token call's time goes (``moe_kernel``'s ``call_overhead``)."""
    out = []
    for r in kernel_records:
        o = pd.DataFrame(r.params["call_overhead"]["rows"])
        chain = o["mainloop_l1_us"] + o["wave_wait_l2_us"] + o["mainloop_l2_us"]
        out.append(f"On {r.platform} (record {rec(r)}) a one-token call ({span(o['rows'], '.0f')} "
                   f"routed rows on this rank) takes {span(o['kernel_wave_us'], '.0f')} µs in the "
                   f"kernel and {span(o['call_wave_us'], '.0f')} µs as a whole call. The host's "
                   f"Python launch takes {span(o['host_launch_us'], '.0f')} µs per call; in the "
                   f"kernel, one Linear-1 tile's mainloop, the Linear-2 tile's wait for it and "
                   f"that tile's mainloop add up to {span(chain, '.0f')} µs (traced): two "
                   f"tiles' whole K loops in series.")
    return Prose(*out)


# The call probe's sequences the passage quotes, and what each put before the kernel
CALL_PROBE_SEQUENCES = {"call": "in the whole call",
                        "idle_all": "after a launch of a few instructions on every SM",
                        "code_all": "after straight-line code on every SM"}


def call_probes(records_by_platform) -> Prose:
    """The ``moe_call_probe`` records (``call_probe.sequence_spans``), one sentence a record: the
    fused kernel's time after each quoted sequence over its time after its own launch, per
    precision, with the commit of the kernel the record timed."""
    from ...analysis.moe.call_probe import sequence_spans
    from ...analysis.moe.layer_view import CELL

    out = []
    for platform, records in records_by_platform.items():
        spans = sequence_spans(records)
        for r in records:
            s = spans[(spans["record"] == r.record_id)
                      & spans["sequence"].isin(list(CALL_PROBE_SEQUENCES))]
            if s.empty:
                continue
            parts = []
            for sequence, said in CALL_PROBE_SEQUENCES.items():
                by = [f"{row.precision} {val(row.over_alone_min, '.3f')}–"
                      f"{val(row.over_alone_max, '.3f')}×"
                      for row in s[s["sequence"] == sequence].itertuples()]
                if by:
                    parts.append(f"{said}, {', '.join(by)}")
            cells = len(r.table[CELL].drop_duplicates())
            tokens = ", ".join(str(n) for n in sorted(r.table["tokens"].unique()))
            out.append(f"On {platform}, record {rec(r)} (the kernel at `{s.iloc[0]['commit']}`, "
                       f"{count(cells)} {plural(cells, 'cell')} at {tokens} tokens), "
                       f"the fused kernel's time over its time right after itself: "
                       + "; ".join(parts) + ".")
    return Prose(*out)


def forecast(forecast_records, paper: dict) -> Prose:
    """The forecast for EP = 2, 4, 8 (``moe_forecast``), against the paper's Table 2."""
    ref = pd.DataFrame(paper["rows"])
    out = []
    for r in forecast_records:
        t = r.table
        parts = []
        for ep, g in t.groupby("ep", sort=True):
            reshape = g[g["action"] == "reshape"]
            gain = g[g["predicted_speedup"] > 1]
            parts.append(f"at EP = {int(ep)} the design test says *reshape* for "
                         f"{count(len(reshape))} of {count(len(g))} shapes, with a predicted "
                         f"stall of {span(g['predicted_stall_us'], '.2f')} µs per Linear-2 burst "
                         f"under Expert-Wave, and Interleaved predicted faster for "
                         f"{count(len(gain))}")
        bound = t[(t["action"] == "reshape") & (t["g_wave_us"] >= t["v_over_r_us"])]
        out.append(f"Forecast {rec(r)} (kernel times of {r.platform}, calibration "
                   f"`{r.params['calibration_record']}`): {'; '.join(parts)}. In "
                   f"{count(len(bound))} of the {count(len(t))} rows the gap between bursts "
                   f"already exceeds V/R, so the stall comes from the burst itself exceeding the "
                   f"capacity Q (eq. 7), which interleaving does not shorten. The paper measured "
                   f"Expert-Wave spans of {ref['span_wave_us'].min()}–{ref['span_wave_us'].max()} "
                   f"µs and Interleaved {ref['span_int_us'].min()}–{ref['span_int_us'].max()} µs "
                   f"at EP = 8 on its platform; the two-GPU run tests this forecast.")
    return Prose(*out)
