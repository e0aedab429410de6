"""The MoE models' routed-expert shapes (``data/moe_shapes.json``), the precisions and routings
the host side takes, and the one error every check of its contract raises. Plain Python: the
analysis of records reads these without torch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHAPES_PATH = Path(__file__).resolve().parents[3] / "data" / "moe_shapes.json"
PRECISIONS = ("bf16", "fp8")
ROUTINGS = ("balanced", "skewed")
E4M3_MAX = 448.0
FP8_SCALE_BLOCK = 128  # DeepSeek-style 1 x 128 activation and 128 x 128 weight scale blocks


class MoEContractError(ValueError):
    """Bad input for the fused MoE path, raised before anything is launched."""


@dataclass(frozen=True)
class MoEShape:
    model: str
    variant: str
    hidden: int
    intermediate: int
    routed_experts: int
    top_k: int
    source: str


def load_shapes(path: Path = SHAPES_PATH) -> dict[str, MoEShape]:
    """The model shapes of ``data/moe_shapes.json``, keyed by model name."""
    doc = json.loads(Path(path).read_text())
    shapes = {}
    for m in doc["models"]:
        s = MoEShape(**m)
        for f in ("hidden", "intermediate", "routed_experts", "top_k"):
            if not isinstance(getattr(s, f), int) or getattr(s, f) < 1:
                raise ValueError(f"{path}: {s.model}.{f} must be a positive integer")
        shapes[s.model] = s
    return shapes



def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise MoEContractError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def check_scale_blocks(hidden: int, intermediate: int, scale_block: int) -> None:
    """FP8's 1 x ``scale_block`` and square ``scale_block`` scales: H and I divisible by it."""
    if hidden % scale_block or intermediate % scale_block:
        raise MoEContractError(f"fp8 needs hidden={hidden} and intermediate={intermediate} "
                               f"divisible by the scale block {scale_block}")


def check_expert_parallel(num_experts: int, world: int) -> int:
    """Experts per rank; raises unless P divides the routed experts."""
    if world < 1 or num_experts % world:
        raise MoEContractError(f"P={world} ranks must divide the {num_experts} routed experts")
    return num_experts // world
