"""The ``moe_layer`` summary entry (``layer_view``) from a record's table, and ``summary`` without
any ``moe_layer`` record."""
import pandas as pd

from xstage_lab.analysis.moe.layer_view import SUMMARY_KEYS, summary_entry


def test_summary_rows_keep_the_issue_fields_in_plain_values():
    row = {k: 1.5 for k in SUMMARY_KEYS}
    row.update(model="DeepSeek-V4-Flash", precision="fp8", setting="ep1", tokens=64, extra=3)
    table = pd.DataFrame([row, {**row, "setting": "ep8_rank"}])
    entry = summary_entry(table)
    assert [r["setting"] for r in entry["rows"]] == ["ep1", "ep8_rank"]
    assert set(entry["rows"][0]) == set(SUMMARY_KEYS)
    assert type(entry["rows"][0]["tokens"]) is int and type(entry["rows"][0]["kernel_us"]) is float


def test_summary_leaves_moe_layer_out_without_records(tmp_path):
    from xstage_lab.summary import ENTRIES, summary

    assert "moe_layer" in ENTRIES
    assert summary(tmp_path) == {"platforms": {}}
