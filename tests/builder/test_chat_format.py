"""engine.json's `chat.tool_call_format`: read from the packaged chat template, wherever the checkpoint keeps it."""

from __future__ import annotations

import json

from kiln.builder.stages.package import chat_document, write_engine_json

HERMES = "{% if tools %}{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}{% endif %}"


def test_tool_call_format_from_each_place_a_template_lives(tmp_path):
    assert chat_document(tmp_path) == {"tool_call_format": "json"}  # no template at all
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{% if tools %}[TOOL_CALLS]{% endif %}"},
                           {"name": "tool_use", "template": HERMES}]}))
    assert chat_document(tmp_path) == {"tool_call_format": "mistral"}
    (tmp_path / "chat_template.jinja").write_text(HERMES)  # the file wins over tokenizer_config.json
    assert chat_document(tmp_path) == {"tool_call_format": "hermes"}
    write_engine_json(tmp_path, {"format_version": 1})
    assert json.loads((tmp_path / "engine.json").read_text())["chat"] == {"tool_call_format": "hermes"}
