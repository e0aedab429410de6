"""The one output shape of the benchmarks (``experiments/output.py``), as ``import-bench`` reads it."""
import json

import pytest

from xstage_lab.experiments.output import write_output
from xstage_lab.records import import_bench_json, read_record

PROV = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "date_utc": "2026-12-01T09:00:00+00:00"}


def test_written_output_imports_as_a_record(tmp_path):
    out = tmp_path / "sub" / "bench.json"
    write_output(out, {"experiment": "x", "raw": {"fa": [1.0, 2.0]}, "provenance": PROV},
                 [{"M": 8192, "method": "fa", "trials_us": [1.0, 2.0]}], indent=1)
    assert set(json.loads(out.read_text())) == {"metadata", "rows"}
    rec = read_record(import_bench_json(out, "fa_a2a", root=tmp_path / "records"))
    assert rec.platform == "h200-x2" and rec.provenance == PROV
    assert rec.params == {"experiment": "x", "raw": {"fa": [1.0, 2.0]}}
    assert rec.table["M"].tolist() == [8192]


def test_metadata_without_provenance_is_refused(tmp_path):
    with pytest.raises(ValueError, match="provenance"):
        write_output(tmp_path / "b.json", {"experiment": "x"}, [])
    assert not (tmp_path / "b.json").exists()
