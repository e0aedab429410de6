"""xstage_lab: a workbench for the X-Stage Burst–Gap model of remote-store overlap on multi-GPU nodes."""
__version__ = "0.1.0"

from .loading import Loaded, load  # noqa: E402  (the one loader of every notebook and the summary)
