"""Notebook 03 (fused MoE): the passages that quote the ``moe`` matrix and ``moe_trace`` records,
by topic: the matrix (``matrix``), the traces, Table 2 and the knee sweep (``traces``), the
regressions (``regressions``), the one-GPU kernel and the forecast (``kernel``), the layer from
the router's output (``fused_layer``). The notebook reads them all from here
(``from xstage_lab.prose import moe as say``).

Each function takes the records the notebook has loaded (every platform's latest) and returns
``Prose``, one paragraph per platform, naming the records it quotes."""
from .fused_layer import layer
from .kernel import call_overhead, call_probes, forecast, kernel
from .matrix import findings, headline, routing
from .regressions import counterfactual, d_sweep, regressions, regressions_scope
from .traces import (condition1, knee_sweep, spans, table2, timeline, trace_scope,
                     traced_causes)

__all__ = ["call_overhead", "call_probes", "condition1", "counterfactual", "d_sweep", "findings",
           "forecast", "headline", "kernel", "knee_sweep", "layer", "regressions",
           "regressions_scope", "routing", "spans", "table2", "timeline", "trace_scope",
           "traced_causes"]
