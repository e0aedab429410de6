"""The paper's published numbers, kept as data in ``data/paper`` so that every figure and table
can show them beside this platform's."""
from __future__ import annotations

import json
from functools import lru_cache

from .records import DATA_DIR

PAPER_DIR = DATA_DIR / "paper"


@lru_cache(maxsize=None)
def published(name: str) -> dict:
    """``data/paper/<name>.json``: e.g. ``table1``, ``table3``, ``moe_headline``."""
    path = PAPER_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no published numbers {path}")
    return json.loads(path.read_text())
