"""Notebook 04 (simulator and design test): the passages that quote the gap sweep against the
simulator, and the design test's verdicts for the attention and MoE kernels."""
from __future__ import annotations

import pandas as pd

from . import Prose, count, plural, rec, span, val, vals, words

KIB = 1024
# Where the aligned and the skewed simulation differ by more than this (relative), the gap sweep
# can tell them apart.
PART_REL = 0.10


def _gaps(g: pd.DataFrame) -> str:
    lo, hi = g["gap_us"].min(), g["gap_us"].max()
    return f"G = {lo:g} µs" if lo == hi else f"G = {lo:g}–{hi:g} µs"


def gap_sweep(characterizations, sims: dict, errors: dict) -> Prose:
    """Item 6 of issue 20: each gap-sweep point's regime (``simulator.skew_regime``) and which
    simulation, aligned or spread over the measured start skew, the measurement follows."""
    out = []
    for c in characterizations:
        p = c.record.platform
        sim, err = sims[p], errors[p]
        if "regime" not in sim:
            continue
        text = (f"On {p} (characterization {rec(c.record)}), the median |error| of T_iss is "
                f"{val(err['simulator_t_iss_err_pct'], '.1f')}% for the aligned simulation, "
                f"{val(err['simulator_skewed_t_iss_err_pct'], '.1f')}% for the producers spread "
                f"over their measured start skew, and "
                f"{val(err['closed_form_t_iss_err_pct'], '.1f')}% for the closed form (eq. 3).")
        regimes = sim["regime"].value_counts()
        text += (" Of its " + str(len(sim)) + " remote points, "
                 + words(f"{count(regimes.get(k, 0))} {k}"
                         for k in ("aligned", "staggered", "drifted")) + ".")
        bullets = []
        for b, grp in sim.sort_values("gap_us").groupby("burst_bytes"):
            grp = grp.sort_values("gap_us")
            # consecutive gaps in one regime
            block = (grp["regime"] != grp["regime"].shift()).cumsum()
            parts = []
            for _, g in grp.groupby(block, sort=False):
                regime = g["regime"].iloc[0]
                against = {"aligned": "under the issue time", "staggered": "under the period",
                           "drifted": "a period or more"}[regime]
                parts.append(f"{regime} at {_gaps(g)} (starts spread over "
                             f"{span(g['start_skew_us'], '.3g', ' µs')}, {against})")
            line = f"* **B = {int(b) // KIB} KiB**: " + "; ".join(parts) + "."
            apart = grp[(grp["t_iss_sim_us"] - grp["t_iss_skew_sim_us"]).abs()
                        > PART_REL * grp["t_iss_skew_sim_us"]]
            if len(apart):
                e_al = (apart["t_iss_sim_us"] / apart["t_iss_us"] - 1).abs()
                e_sk = (apart["t_iss_skew_sim_us"] / apart["t_iss_us"] - 1).abs()
                follows = ("the skewed one" if (e_sk < e_al).all() else
                           "the aligned one" if (e_al < e_sk).all() else
                           f"the skewed one at {count((e_sk < e_al).sum())} of them")
                line += (f" Where the two simulations part ({_gaps(apart)}), the measured T_iss, "
                         f"{span(apart['t_iss_us'], '.3g', ' µs')}, follows {follows}: "
                         f"{span(apart['t_iss_skew_sim_us'], '.3g', ' µs')} with the measured "
                         f"skew, {span(apart['t_iss_sim_us'], '.3g', ' µs')} aligned.")
            else:
                line += " The two simulations agree at every gap."
            bullets.append(line)
        out.append(text + "\n\n" + "\n".join(bullets))
    return Prose(*out)


def attention_verdicts(fa_records) -> Prose:
    """The design test for the attention kernel's aligned worst case against the measured
    paired residual, on each platform's latest ``fa_a2a`` record."""
    from .. import plots
    from ..analysis.attention.model import record_predictions, verdict_agreement
    from ..analysis.remote_store.characterization import latest_calibration
    from ..loading import latest as latest_record

    out = []
    for r in fa_records:
        v = verdict_agreement(record_predictions(r))
        cfg = r.params["config"]
        cal = latest_calibration(r.platform)
        first = v.iloc[0]
        tile = int(first["burst_volume"] / first["producers"])
        q = cal.platform_model().capacity_at(int(first["producers"]))
        text = (f"On the latest record, {rec(r)} ({plots.fa_kernel(r)}: {cfg['BLOCK_M']} × "
                f"{cfg['BLOCK_N']} tiles, {cfg['ctas_per_sm']} {plural(cfg['ctas_per_sm'], 'program')}"
                f" per SM: {int(first['producers'])} producers), at calibration "
                f"{rec(latest_record('calibration', r.platform))}: ")
        fails = v[~v["capacity_bound"].astype(bool)]
        if len(fails) == len(v):
            text += (f"the capacity bound fails at every M: {int(first['producers'])} aligned "
                     f"output tiles of {tile // KIB} KiB, {val(first['burst_volume'] / 1e6, '.2f')}"
                     f" MB, against the calibrated Q of {val(q / 1e6, '.2f')} MB.")
        else:
            text += (f"the capacity bound fails at {words(int(m) for m in fails['M']) if len(fails) else 'no M'}.")
        actions = v["action"].unique()
        text += (f" So the verdict is {actions[0]} throughout." if len(actions) == 1 else
                 " The verdicts: " + words(f"{a} at M = {words(int(m) for m in g['M'])}"
                                           for a, g in v.groupby("action")) + ".")
        yes, no = v[v["agrees"] == "yes"], v[v["agrees"] == "no"]
        if len(yes):
            text += f" It agrees at M = {words(int(m) for m in yes['M'])}."
        if len(no):
            below = no[no["e_res_paired_fa_same_code_p75_us"] < 0]
            text += f" **It does not agree at M = {words(int(m) for m in no['M'])}**"
            if len(below):
                text += (f"; at M = {words(int(m) for m in below['M'])} Fused ran faster than the "
                         "same-code FA-only (the whole IQR of the paired residual is below zero)")
            text += "."
        above = yes[(yes["action"] == "reshape")
                    & (yes["excess_us"] > 1.5 * yes["e_capacity_bound_us"])]
        if len(above):
            text += (f"\n\nWhere it agrees, it agrees in kind only. At M = "
                     f"{words(int(m) for m in above['M'])} the measured residual "
                     f"({vals_us(above['excess_us'])}) is well above `e_capacity_bound_us` "
                     f"({vals_us(above['e_capacity_bound_us'])})")
            fenced = "e_res_fenced_paired_fa_same_code_us"
            if fenced in v:
                text += (f", and the fenced Fused, which cannot build an X-Stage at all, leaves "
                         f"{vals_us(above[fenced])} at the same M (notebook 02)")
            text += (". In `data/records/fa_power_probe` the cost is the clock under the GPUs' "
                     "power cap, a term the design test does not have.")
        out.append(text)
    return Prose(*out)


def vals_us(values) -> str:
    return vals(values, ".0f", " µs")


def trace_launch_order(table: pd.DataFrame) -> Prose:
    """``analysis.attention.trace.first_wave_by_launch_order``: the first wave by what the
    traced launch followed."""
    if table.empty:
        return Prose()
    parts = []
    for follows, g in table.groupby("traced_launch_follows", sort=False):
        parts.append(f"* After **{follows}** ({words(rec(x) for x in g['record'].unique())}): the "
                     f"longest first-wave epilogue is {span(g['epilogue_fused_max_us'], '.1f')} µs"
                     f" and the mean excess {span(g['excess_us'], '.2f')} µs.")
    return Prose("The first wave of the rank that sends most in it, per trace (the last table "
                 "below):\n\n" + "\n".join(parts))


def trace_verdicts(record, verdicts: pd.DataFrame, simulated: pd.DataFrame) -> Prose:
    """The design test on the measured attention bursts, first wave and later waves, and the
    simulator on the measured schedule."""
    from .. import plots
    from ..analysis.remote_store.characterization import latest_calibration
    from ..loading import latest as latest_record

    cal = latest_calibration(record.platform)
    platform = cal.platform_model()
    programs = int(record.provenance["gpus"][0]["sm_count"] * record.params["config"]["ctas_per_sm"])
    q = platform.capacity_at(programs)
    yes = verdicts["agrees"] == "yes"
    ms = sorted(verdicts["M"].unique())
    ranks = sorted(verdicts["rank"].unique())
    text = (f"On the {plots.fa_kernel(record)} trace {rec(record)}, at calibration "
            f"{rec(latest_record('calibration', record.platform))} (R = "
            f"{val(cal.drain_rate_GBps, '.0f')} GB/s, Q = {val(q / 1e6, '.2f')} MB at "
            f"{programs} SMs), **{count(yes.sum())} of the {len(verdicts)} verdicts agree**.")
    full = len(ms) * len(ranks) * 2
    if len(verdicts) < full:
        text += (f" There are {len(verdicts)} cells and not {full}: a wave whose tiles all lie "
                 "in the rank's own rows sends nothing.")
    bullets = []
    for wave, g in verdicts.groupby("wave_class", sort=False):
        agree = g["agrees"] == "yes"
        line = (f"* **{wave.capitalize()} {plural(len(g), 'wave')}: {count(agree.sum())} of "
                f"{count(len(g))}.** The test says "
                + words(f"{a} in {count(n)}" for a, n in g["action"].value_counts().items())
                + f" (arrival peaks {span(g['arrival_peak_bytes'] / 1e6, '.2f')} MB, "
                f"{span(g['arrival_peak_bytes'] / q, '.2f')} Q); the mean excess per remote tile is "
                f"{span(g['excess_us'], '.2f')} µs against tolerances of "
                f"{span(g['tolerance_us'], '.2f')} µs.")
        miss = g[~agree]
        if len(miss):
            line += (" It misses at " + words(f"M = {int(r.M)} rank {int(r.rank)} "
                                             f"({val(r.excess_us, '.2f')} µs, peak "
                                             f"{val(r.arrival_peak_bytes / q, '.2f')} Q)"
                                             for r in miss.itertuples()) + ".")
            if (miss["action"] == "piggyback").all() and (miss["arrival_peak_bytes"] < q).all():
                line += (" The fluid model says nothing waits until the outstanding volume "
                         "reaches Q; these waves wait before that.")
        bullets.append(line)
    if len(simulated):
        first = simulated[simulated["wave_class"] == "first"]
        pred = simulated["stall_pred_mean_us"].abs().max()
        sim = ("predicts no stall anywhere on this trace" if pred < 0.005 else
               f"predicts a mean stall of at most {val(pred, '.2f')} µs per remote tile")
        bullets.append(f"* **The simulator** {sim}, against a mean of "
                       f"{span(first['excess_mean_us'], '.2f')} µs per first-wave remote tile "
                       f"measured. The Q-loop between bursts is "
                       f"{span(verdicts['gap_us'], '.0f')} µs.")
    return Prose(text + "\n\n" + "\n".join(bullets))


def moe_verdicts(trace_records) -> Prose:
    """The design test for the fused MoE kernel against the measured spans."""
    from ..analysis.moe import trace as moe_trace
    from ..analysis.remote_store.characterization import latest_calibration
    from ..loading import latest as latest_record

    out = []
    for r in trace_records:
        v = pd.DataFrame(moe_trace.design_verdicts(r.table,
                                                   latest_calibration(r.platform).platform_model()))
        if v.empty:
            continue
        no = v[v["agrees"] == "no"]
        text = (f"On the latest record, {rec(r)} (at calibration "
                f"{rec(latest_record('calibration', r.platform))}), **{count(len(v) - len(no))} "
                f"of the {len(v)} verdicts agree**.")
        names = {"wave": "Expert-Wave", "interleaved": "Interleaved"}
        for row in no.itertuples():
            text += (f" **{row.model} under {names[row.schedule]} does not**: its gap of "
                     f"{val(row.gap_us, '.2f')} µs against G* = {val(row.g_star_us, '.2f')} µs makes "
                     f"the test say {row.action}, with a predicted overhead of "
                     f"{val(row.dT_iss_pred_us, '.2f')} µs against the control's spread of "
                     f"{val(row.tolerance_us, '.2f')} µs; the measured excess is "
                     f"{val(row.excess_us, '+.3f')} µs.")
            other = v[(v["model"] == row.model) & (v["schedule"] != row.schedule)]
            for o in other.itertuples():
                text += (f" Under {names[o.schedule]}, {o.model}'s gap is "
                         f"{val(o.gap_us, '.1f')} µs and the verdict {o.action}, which "
                         f"{'agrees' if o.agrees == 'yes' else 'does not agree'}.")
        out.append(text)
    return Prose(*out)
