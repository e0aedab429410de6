"""The MoE benchmark's options: the configuration matrix as data, and bad input refused before
any GPU work."""
import itertools
from pathlib import Path

import pytest

from xstage_lab.experiments import harness
from xstage_lab.experiments.moe import bench as moe_bench
from xstage_lab.ops.moe.shapes import load_shapes

MATRIX = Path(__file__).resolve().parents[3] / "data" / "moe_matrix.json"


def parse(argv):
    return harness.parse(moe_bench.EXPERIMENT, argv)


def cells(args):
    """(model, precision, routing, tokens) of the cells the run measures, in run order."""
    sweep, = moe_bench.EXPERIMENT.sweeps(args)
    points = sweep.points()
    indices, = harness.chunk_indices([sweep], args.chunk)
    return [(points[i]["model"], points[i]["precision"], points[i]["routing"], points[i]["tokens"])
            for i in indices]


def test_the_matrix_declares_84_configurations():
    args = parse(["--out", "x.json", "--matrix", str(MATRIX)])
    sweep = moe_bench.matrix_sweep(args)
    assert [a.name for a in sweep.axes] == ["model", "precision", "routing", "tokens"]
    run_cells = cells(args)
    # the declared order is the product's, model outermost (the bench loads weights per model)
    assert run_cells == list(itertools.product(args.models, args.precisions, args.routing,
                                               args.tokens))
    assert len(run_cells) == 84
    assert set(args.models) == set(load_shapes())
    assert args.tokens == [2048, 4096, 8192]


def test_default_run_is_one_token_count():
    args = parse(["--out", "x.json"])
    assert args.tokens == [moe_bench.DEFAULT_TOKENS]


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--tokens", "1024,x"], ["--warmup", "-1"],
                                 ["--graph-iters", "0"], ["--lead", "0"], ["--programs", "0"],
                                 ["--models", "NoSuchModel"], ["--precisions", "fp4"]])
def test_bad_options_are_refused(bad):
    with pytest.raises(SystemExit):
        parse(["--out", "x.json", *bad])


def test_matrix_chunks_cover_every_cell_once():
    full = cells(parse(["--out", "x", "--matrix", str(MATRIX)]))
    assert len(full) == 84 and len(set(full)) == 84
    parts = [cells(parse(["--out", "x", "--matrix", str(MATRIX), "--chunk", f"{i}/3"]))
             for i in range(3)]
    assert sum(parts, []) == full and all(len(p) == 28 for p in parts)
    with pytest.raises(SystemExit):
        parse(["--out", "x", "--chunk", "3/3"])
