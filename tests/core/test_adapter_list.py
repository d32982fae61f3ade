"""The adapter list (kiln/adapter_list.py): what the operator and ``kiln up`` write is what serving reads."""

from __future__ import annotations

import json

from kiln import adapter_list


def test_what_is_written_is_what_a_server_of_that_base_reads(tmp_path):
    entries = [adapter_list.entry("tone", "file:///s/engines/b-tone", "b-tone", "b"),
               adapter_list.entry("sql", "file:///s/engines/b-sql", "b-sql", "b", content_digest="d" * 64),
               adapter_list.entry("tone", "file:///s/engines/a-tone", "a-tone", "a")]
    path = adapter_list.write(tmp_path / "new" / "adapters.json", entries)
    doc = json.loads(path.read_text())
    assert doc["format"] == adapter_list.FORMAT
    assert [(e["baseEngineVersion"], e["name"]) for e in doc["adapters"]] == [("a", "tone"), ("b", "sql"),
                                                                              ("b", "tone")]
    assert set(adapter_list.wanted(doc, "b")) == {"sql", "tone"}
    assert adapter_list.wanted(doc, "b")["sql"]["contentDigest"] == "d" * 64
    assert "contentDigest" not in adapter_list.wanted(doc, "b")["tone"]  # nobody pinned one


def test_a_document_of_another_format_or_shape_lists_nothing():
    assert adapter_list.wanted({"format": adapter_list.FORMAT + 1, "adapters": []}, "b") == {}
    assert adapter_list.wanted([], "b") == {}
    assert adapter_list.wanted({"format": adapter_list.FORMAT, "adapters": [{"name": 1}, "x"]}, "b") == {}
