"""Figures and tables, grouped by experiment family, drawn only from records and the fits and
rows the experiment modules compute from them; ``publish`` is where they are written for
``reproduce``, ``widgets`` holds the notebooks' interactive explorers. Every public name is
re-exported here, so that notebooks call ``plots.<name>``."""
from .attention import (FA_KERNEL_LABELS, attention_epilogue_spans, fa_a2a_times, fa_kernel,
                        fa_label, fig11_residual, table3_comparison)
from .host_link import attention_links, moe_host_speedups
from .moe import (MOE_KERNEL_COLUMNS, moe_call_overhead, moe_call_probe_table, moe_d_sweep,
                  moe_d_sweep_rows, moe_forecast_table, moe_headline, moe_kernel_cells,
                  moe_kernel_ratio, moe_knee_sweep, moe_layer_call_excess, moe_layer_speedups,
                  moe_span_distributions, moe_speedups, moe_table2, moe_tensor_core_timeline,
                  moe_trace_runs)
from .publish import (NO_IMAGES_HINT, PLOTLYJS, image_engine_problem, publish, publish_table,
                      ship_plotlyjs, show, static_image)
from .remote_store import (calibration_summary_table, drain_rate_heatmap, fig3a_issue_time,
                           fig3b_period, fig3c_isolated, fig3d_drain_rate, fig_two_worlds,
                           fig_visibility_latency, operations_gap_sweeps, patterns_drain_heatmap,
                           patterns_rates, table1_comparison,
                           visibility_alignment_table, visibility_completion_table,
                           visibility_first_burst_table, visibility_latency_table)
from .simulator import simulated_gap_sweep, simulated_schedules
from .widgets import design_calculator, explore_burst_gap
