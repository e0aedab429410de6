"""Notebook 02 (Ulysses attention with its All-to-All): the passages that quote the ``fa_a2a``,
``fa_tuning``, ``fa_kernel_probe`` and ``fa_power_probe`` records."""
from __future__ import annotations

import pandas as pd

from . import Prose, count, rec, span, val, vals, words

# Where Fused saves at most this much over Serial, NCCL's All-to-All's own share is set beside.
SMALL_GAIN = 1.02


def _kernel(r) -> str:
    from ..plots import fa_kernel

    return fa_kernel(r)


def _shape(r) -> str:
    p, c = r.params["params"], r.params.get("config") or {}
    tiles = f"{c['BLOCK_M']} × {c['BLOCK_N']} tiles, " if "BLOCK_M" in c else ""
    return (f"{_kernel(r)}: {tiles}H = {p['heads']}, P = {p['P']}, d = {p['head_dim']}")


def _ms(values) -> str:
    return words(int(m) for m in values)


def headline(records) -> Prose:
    """What each platform's latest ``fa_a2a`` record shows: FA-only against cuDNN, Fused against
    Serial and against SDPA + NCCL, and the remote-store All-to-All against NCCL's."""
    out = []
    for r in records:
        t = r.table.sort_values("M")
        ratio = t["fa_tflops"] / t["cudnn_tflops"]
        bullets = [f"FA-only reaches {span(ratio, '.2f')} of cuDNN's TF/s "
                   f"({span(t['fa_tflops'], '.0f')} TF/s) at M = {_ms(t['M'])}."]
        line = (f"**Fused against Serial** at M = {_ms(t['M'])}: {vals(t['speedup'], '.3f')}.")
        slow = t[t["speedup"] <= 1]
        if len(slow):
            line += f" **At M = {_ms(slow['M'])} Fused is not faster than Serial.**"
        small = t[t["speedup"] <= SMALL_GAIN]
        if len(small):
            share = small["a2a_nccl_us"] / small["fa_us"] * 100
            line += (f" Where it saves at most {(SMALL_GAIN - 1) * 100:.0f}% (M = {_ms(small['M'])})"
                     f", NCCL's All-to-All alone is {span(share, '.1f')}% of FA-only.")
            odd = small[(small["serial_us"] - small["fa_us"]) < 0.5 * small["a2a_nccl_us"]]
            if len(odd):
                line += (f" At M = {_ms(odd['M'])} Serial exceeds FA-only by only "
                         f"{vals(odd['serial_us'] - odd['fa_us'], '.0f', ' µs')}, while NCCL's "
                         f"All-to-All alone takes {vals(odd['a2a_nccl_us'], '.0f', ' µs')}: the "
                         "two halves of Serial do not add up.")
        bullets.append(line)
        bullets.append(f"**Fused against SDPA (cuDNN) + NCCL**, what users run today: "
                       f"{vals(t['speedup_over_sdpa_nccl'], '.3f')}.")
        bullets.append(f"**The remote-store All-to-All** takes "
                       f"{span(t['a2a_remote_us'] / t['a2a_nccl_us'], '.2f')} of NCCL's time.")
        out.append(f"What the latest record of {r.platform}, {rec(r)} ({_shape(r)}; commit "
                   f"`{r.git_commit[:7]}`), shows:\n\n" + "\n".join(f"- {b}" for b in bullets))
    return Prose(*out)


def history(records) -> Prose:
    """The platform's other ``fa_a2a`` records, one line each."""
    from ..loading import record_paths as list_records, read as read_record

    out = []
    for latest in records:
        lines = []
        for path in list_records("fa_a2a", latest.platform):
            r = read_record(path)
            if r.record_id == latest.record_id:
                continue
            t = r.table
            lines.append(f"- {rec(r)} ({_shape(r)}): FA-only at "
                         f"{span(t['fa_tflops'] / t['cudnn_tflops'], '.2f')} of cuDNN, Fused over "
                         f"Serial {span(t['speedup'], '.3f')} at M = {_ms(t['M'])}.")
        if lines:
            out.append(f"The other `fa_a2a` records of {latest.platform}, oldest first:\n\n"
                       + "\n".join(lines))
    return Prose(*out)


def power() -> Prose:
    """The ``fa_power_probe`` records: power against the limit, clock and time per call by
    method; on one GPU, how much of a near-idle phase after FA-only comes back as clock."""
    from ..loading import record_paths as list_records, platforms, read as read_record

    out = []
    for platform in platforms("fa_power_probe"):
        for path in list_records("fa_power_probe", platform):
            r = read_record(path)
            t = r.table
            limit = t["power_limit_w"].median()
            busy = t[t["power_w_mean"] > 0.5 * limit]
            head = (f"{rec(r)} ({platform}): the methods that run FA draw "
                    f"{span(busy['power_w_mean'], '.0f')} W on average against a limit of "
                    f"{val(limit, '.0f')} W (software power cap active "
                    f"{span(busy['sw_power_cap_frac'] * 100, '.0f')}% of the samples).")
            if "gap_us" in t:  # one GPU: FA-only, then a near-idle phase of gap_us
                base = t[t["method"] == "fa"].groupby(["M", "head_dim"])["us_per_call"].median()
                parts = []
                for (m, d, g), grp in t[t["method"] == "fa+gap"].groupby(["M", "head_dim", "gap_us"]):
                    added = grp["us_per_call"].median() - base.loc[(m, d)]
                    parts.append(f"a {g} µs phase adds {val(added, '.0f')} µs at M = {m}, d = {d} "
                                 f"({val((1 - added / g) * 100, '.0f')}% of it comes back)")
                out.append(head + " After each FA-only launch, " + "; ".join(parts) + ".")
                continue
            med = t.groupby("method").agg(us=("us_per_call", "median"),
                                          mhz=("sm_clock_mhz_median", "median"))
            if "fused" in med.index:
                others = [m for m in med.index if m != "fused"]
                head += (" Median SM clock: " + words(f"{m} {val(med.loc[m, 'mhz'], '.0f')} MHz"
                                                      for m in med.index) + ".")
                per_m = t.groupby(["M", "method"])["us_per_call"].median().unstack()
                for o in others:
                    diff = (per_m["fused"] / per_m[o] - 1) * 100
                    head += (f" Fused takes {span(diff, '+.1f')}% per call against {o} at "
                             f"M = {_ms(per_m.index)}.")
            out.append(head)
    return Prose(*out)


def tuning(table: pd.DataFrame) -> Prose:
    """The latest tuning run of each head dim and local head count: the fastest configuration
    per M and its paired ratio to cuDNN."""
    from ..analysis.attention.model import tuning_best

    best = tuning_best(table)
    heads = table.groupby("record")["heads"].first()
    best = best.assign(heads=best["record"].map(heads))
    order = list(dict.fromkeys(table["record"]))
    lines = []
    for (d, h), g in best.groupby(["head_dim", "heads"], sort=True):
        last = max(g["record"].unique(), key=order.index)
        g = g[g["record"] == last].sort_values("M")
        lines.append(f"- d = {d}, {h} local heads, {rec(last)}: "
                     + words(f"{val(r.over_cudnn_paired, '.3f')} with `{r.method}` at M = {r.M}"
                             for r in g.itertuples()) + ".")
    return Prose("The latest run of each head dim and head count, fastest configuration per M "
                 "(paired ratio to cuDNN):\n\n" + "\n".join(lines))


def kernel_probes() -> Prose:
    """The one-GPU ``fa_kernel_probe`` records: each variant against cuDNN, or each build
    against its LOCAL build."""
    from ..loading import record_paths as list_records, platforms, read as read_record

    lines = []
    for platform in platforms("fa_kernel_probe"):
        for path in list_records("fa_kernel_probe", platform):
            r = read_record(path)
            t = r.table
            if "build" in t:
                parts = [f"`{k}` {b} minus LOCAL {span(g['minus_local_paired_pct'], '+.2f')}%"
                         for (k, b), g in t[t["build"] != "local"].groupby(["kernel", "build"])]
                lines.append(f"- {rec(r)} ({platform}, paired, one rotation): "
                             + "; ".join(parts) + ".")
            elif "method" in t:
                ours = t[t["method"] != "cudnn"]
                parts = [f"`{m}` {span(g['over_cudnn_paired'], '.2f')} of cuDNN"
                         for m, g in ours.groupby("method")]
                pivot = ours.pivot_table(index=["head_dim", "heads", "M"], columns="method",
                                         values="median_us")
                variants = list(pivot.columns)
                if len(variants) == 2:
                    a, b = variants
                    faster = pivot[b] / pivot[a]
                    parts.append(f"`{a}` {span(faster, '.2f')}× as fast as `{b}`")
                lines.append(f"- {rec(r)} ({platform}): " + "; ".join(parts) + ".")
    return Prose("The kernel probes (one GPU):\n\n" + "\n".join(lines)) if lines else Prose()


def residuals(predictions: dict) -> Prose:
    """Fig. 11: the predictions against the paired residuals of the latest records."""
    from ..analysis.attention.model import prediction_check

    out = []
    for platform, table in predictions.items():
        c = prediction_check(table).sort_values("M")
        x = c["x_stage_pct"]
        text = (f"On {platform}, the X-Stage prediction is "
                + ("zero at every M: the Q-loop covers each wave's drain." if (x == 0).all() else
                   f"{vals(x, '.2f', '%')} of T_FA at M = {_ms(c['M'])}.")
                + f" The decoupled Fused's residual against the same-code control is "
                f"{vals(c['measured_pct'], '.2f', '%')} of T_FA")
        excl = c[(c["measured_p25_pct"] > 0) | (c["measured_p75_pct"] < 0)]
        text += (", and its IQR excludes zero at every M." if len(excl) == len(c) else
                 f"; its IQR excludes zero at M = {_ms(excl['M'])}." if len(excl) else
                 "; its IQR includes zero at every M.")
        if "completion_coupled_in_iqr" in c:
            inside = c[c["completion_coupled_in_iqr"].astype(bool)]
            text += (f" The completion-coupled prediction ({vals(c['completion_coupled_pct'], '.1f', '%')})"
                     f" lies inside the fenced residual's IQR at "
                     + (f"M = {_ms(inside['M'])}" if len(inside) else "no M")
                     + (" only." if 0 < len(inside) < len(c) else "."))
        faster = c[c["measured_p75_pct"] < 0]
        if len(faster):
            text += (f" At M = {_ms(faster['M'])} Fused runs faster than the same-code control "
                     f"({vals(faster['measured_pct'], '.1f', '%')}, the whole IQR below zero); "
                     "no term of the model explains that, and the records do not say why.")
        out.append(text)
    return Prose(*out)


def fenced(records) -> Prose:
    """The fenced Fused against the decoupled one, paired per trial: the latest record of each
    platform in detail, the others one line each."""
    from ..analysis.attention.model import fenced_vs_decoupled
    from ..loading import record_paths as list_records, read as read_record

    out = []
    for latest in records:
        f = fenced_vs_decoupled(latest)
        if f.empty:
            continue
        f = f.sort_values("M")
        slower = f[f["fenced_minus_fused_us"] > 0]
        faster = f["fenced_faster_trials"].str.split("/", expand=True).astype(int)
        text = (f"What the latest record, {rec(latest)} ({_kernel(latest)}), shows in the table "
                "above: the fenced Fused is slower than the decoupled one at "
                + ("every M" if len(slower) == len(f) else f"M = {_ms(slower['M'])}")
                + f", by {vals(f['fenced_minus_fused_us'], '.0f', ' µs')} "
                f"({vals(f['rel_pct'], '.2f', '%')}) at M = {_ms(f['M'])}. At no M was the fenced "
                f"one faster in more than {count(faster[0].max())} of the {int(faster[1].max())} "
                "trials.")
        if "fenced_build_minus_same_code_us" in f:
            text += (" The fenced build storing locally minus the same-code control is "
                     f"{span(f['fenced_build_minus_same_code_us'], '+.0f')} µs.")
        if "fa_minus_same_code_us" in f:
            text += (" FA-only's LOCAL build minus the same-code control, a pair that differs only"
                     f" by its build, is {span(f['fa_minus_same_code_us'], '+.0f')} µs.")
        lines = []
        for path in list_records("fa_a2a", latest.platform):
            r = read_record(path)
            if r.record_id == latest.record_id:
                continue
            g = fenced_vs_decoupled(r)
            if g.empty:
                continue
            n = g["fenced_faster_trials"].str.split("/", expand=True).astype(int)
            lines.append(f"- {rec(r)} ({_kernel(r)}): fenced minus decoupled "
                         f"{span(g['fenced_minus_fused_us'], '+.0f')} µs, the fenced one faster in "
                         f"at most {count(n[0].max())} of {int(n[1].max())} trials"
                         + (f"; its fenced build storing locally minus the same-code control "
                            f"{span(g['fenced_build_minus_same_code_us'], '+.0f')} µs"
                            if "fenced_build_minus_same_code_us" in g else "") + ".")
        if lines:
            text += "\n\nThe earlier records of this platform:\n\n" + "\n".join(lines)
        out.append(text)
    return Prose(*out)


def _verdicts(actions: pd.Series, ms: pd.Series) -> str:
    """The design test's action at every M, or per action where they differ."""
    if actions.nunique() == 1:
        return f"{actions.iloc[0]} at every M"
    return "; ".join(f"{a} at M = {_ms(ms[actions == a])}" for a in sorted(actions.unique()))


def _mx(t: pd.DataFrame, link: str) -> str:
    """A link's M_X as the model used it for the aligned wave: T_iss⁰, R and Q(K)."""
    return (f"T_iss⁰ = {span(t[f'{link}_t_iss0_us'], '.2f')} µs, R = "
            f"{val(t[f'{link}_drain_rate_GBps'].iloc[0], '.1f')} GB/s, Q = "
            f"{span(t[f'{link}_capacity_bytes'] / 2**20, '.2f')} MiB")


def host_link(records, host_links, by_link: dict) -> Prose:
    """The attention model on the host link's M_X beside NVLink's (``by_link``:
    ``attention_model.host_link_comparisons``), saying that no attention run stored its output
    over the host link."""
    if not by_link:
        return Prose("No host-link calibration is among the records: the attention model is not "
                     "drawn on the host link here.")
    fa = {r.platform: r for r in records}
    host = {c.record.platform: c.record for c in host_links}
    out = ["No attention run has stored its output over the host link: the records hold no "
           "host-link attention measurement, so what follows is the model alone, on the FA-only "
           "times measured with NVLink."]
    for (platform, host_platform), t in by_link.items():
        pct = {f"{link}_{m}": t[f"{link}_{m}_us"] / t["fa_us"] * 100
               for link in ("nvlink", "host") for m in ("e_drain", "e_cc")}
        out.append(
            f"{rec(fa[platform])} ({platform}, Q-loop gaps of {span(t['g_qloop_us'], '.0f')} µs) "
            f"on the host link's M_X ({rec(host[host_platform])}: {_mx(t, 'host')}) against its "
            f"NVLink M_X ({_mx(t, 'nvlink')}): the recovery gap G* is "
            f"{span(t['host_g_star_us'], '.1f')} µs against {span(t['nvlink_g_star_us'], '.1f')} "
            f"µs, and the design test says {_verdicts(t['host_action'], t['M'])} on the host "
            f"link, {_verdicts(t['nvlink_action'], t['M'])} on NVLink. The predicted X-Stage "
            f"residual (eqs. 18–19) is {span(pct['host_e_drain'], '.1f')}% of T_FA on the host "
            f"link against {span(pct['nvlink_e_drain'], '.1f')}% on NVLink; the "
            f"completion-coupled one (eq. 17, T_lat = {val(t['host_t_lat_us'].iloc[0], '.2f')} µs "
            f"and {val(t['nvlink_t_lat_us'].iloc[0], '.2f')} µs) "
            f"{span(pct['host_e_cc'], '.1f')}% against {span(pct['nvlink_e_cc'], '.1f')}%.")
    return Prose(*out)
