"""Every notebook replayed in one Jupyter kernel, for the tests that replay all of them
(``reproduced`` in conftest.py, test_prose's synthetic record set, test_summary_snapshot).

``runner.reproduce`` starts a kernel for each notebook, and each imports torch, pandas, plotly and
the package again: about 3 s of each notebook, 40 s of the three replays of a test run. ``replay``
runs the notebooks of one ``reproduce`` call in the kernel the first of them starts, each from a
fresh namespace (IPython's reset: every name, the history and the execution count gone, as in a
kernel of its own; only the imported modules stay), and shuts it down when the call returns. The
notebooks write what they write in a kernel each (their tables, figures and passages alike);
``reproduce``'s kernel per notebook is the one of
test_notebooks.py::test_failing_notebook_gives_nonzero_exit_and_names_the_cell.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

# Run before each notebook but the first. Besides the names, one thing of the package's stays in
# a kernel, for every notebook of it: plots.publish's "said" (why figures have no image, printed
# with a kernel's first figure), which the reset clears, so each notebook says it as in a kernel
# of its own.
RESET = """\
import sys
publish = sys.modules.get("xstage_lab.plots.publish")
if publish is not None:
    publish._engine.pop("said", None)
get_ipython().reset(new_session=True)
"""


def replay(out: Path) -> int:
    """``runner.reproduce(backend="replay", out=out)`` with its notebooks in one kernel."""
    import papermill as pm
    from jupyter_client.manager import AsyncKernelManager

    from xstage_lab import runner

    km = AsyncKernelManager(kernel_name="python3")
    execute = pm.execute_notebook

    def in_one_kernel(*args, **kwargs):
        if km.has_kernel:  # the names the last notebook left, cleared
            kc = km.blocking_client()
            kc.start_channels()
            try:
                reply = kc.execute_interactive(RESET, silent=True, store_history=False,
                                               timeout=60)
            finally:
                kc.stop_channels()
            assert reply["content"]["status"] == "ok", reply["content"]
        return execute(*args, km=km, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pm, "execute_notebook", in_one_kernel)
        try:
            return runner.reproduce(backend="replay", out=out)
        finally:
            if km.has_kernel:
                asyncio.run(km.shutdown_kernel())
