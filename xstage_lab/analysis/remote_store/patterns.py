"""What is read of a ``remote_patterns`` record on the CPU (issue 6 part 1): every source's fit
per route set with its no-refit errors (``pattern_fits``) and the summary's ``patterns`` entry."""
from __future__ import annotations

import pandas as pd

from .operations import fit_config, fit_entry
from .routes import drain_share, format_routes, parse_routes


def baseline_route(src: int, dsts: tuple[int, ...]) -> str:
    """The one-to-one route whose fit predicts source ``src`` of a pattern with no refit."""
    return format_routes(((src, (dsts[0],)),))


def pattern_fits(table: pd.DataFrame, platform: str) -> dict[str, list[dict]]:
    """Per route set, per source: the fitted (T_iss⁰, R, Q) and the no-refit errors (from the
    source's own fit, and from its one-to-one route's fit times its drain share)."""
    fits = {(routes, src): fit_config(rows, routes, int(src), platform, "this record")
            for (routes, src), rows in table.groupby(["routes", "src"])}
    out: dict[str, list[dict]] = {}
    for routes in dict.fromkeys(r for r, _ in fits):
        share = drain_share(parse_routes(routes))
        entries = []
        for src, dsts in parse_routes(routes):
            base = fits.get((baseline_route(src, dsts), src))
            entries.append(fit_entry(fits[(routes, src)],
                                     base.calibration if base is not None else None, share[src]))
        out[routes] = entries
    return out


def summary_entry(params: dict, record_id: str) -> dict:
    """The ``patterns`` entry of ``summary --json`` from a ``remote_patterns`` record's
    parameters: every pattern instance with its route set, the one-to-one route set it
    degenerates to on this machine (or null) and every source's fit (null where not measured)."""
    return {"gpus": params["gpus"], "degenerate": params["degenerate"],
            "per_instance": [{**i, "sources": params["fits"].get(i["routes"])}
                             for i in params["instances"]],
            "gpu_start_spread_ns_median": params["gpu_start_spread_ns_median"],
            "excluded": params["excluded"], "source_record": record_id}
