"""xstage_lab: a workbench for the X-Stage Burst–Gap model of remote-store overlap on multi-GPU nodes."""
__version__ = "0.1.0"

from .launch import measure  # noqa: E402,F401  (a live run where the backend is cuda; then load)
from .loading import Loaded, load  # noqa: E402,F401  (the one door to the records)
