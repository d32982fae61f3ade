"""How a manifest's YAML is read: what kubectl would refuse, or read otherwise than the user meant, is one line
naming where and the fix (kiln.manifest)."""

from __future__ import annotations

import pytest

from kiln.manifest import ManifestError, load_manifest

HEAD = "apiVersion: serving.kiln.dev/v1alpha1\nkind: LLMEngine\nmetadata: {name: demo}\n"


def test_a_key_given_twice_is_refused_naming_its_line():
    """PyYAML keeps the last of two `gpu:` silently, so the plan was for a GPU the user may not have meant."""
    text = HEAD + "spec:\n  model: {source: hf://org/m}\n  gpu: L4\n  gpu: H100-80GB\n"
    with pytest.raises(ManifestError) as err:
        load_manifest(text)
    assert err.value.problems == ["line 7, column 3: invalid YAML (duplicate key 'gpu': remove one of them); fix "
                                  "the syntax there"]


def test_merge_keys_may_still_be_overridden():
    text = HEAD + "spec:\n  model: &m {source: hf://org/m}\n  speculative:\n    method: draft_model\n" \
        "    draftModel:\n      <<: *m\n      source: hf://org/draft\n  gpu: L4\n"
    assert load_manifest(text).spec.speculative.draft_model.source == "hf://org/draft"


@pytest.mark.parametrize("word", ["off", "no", "false"])
def test_an_unquoted_off_says_to_quote_it(word):
    """docs/api.md's `speculative.method: off` is read by YAML 1.1 as false: say so, and how to write it."""
    text = HEAD + f"spec:\n  model: {{source: hf://org/m}}\n  gpu: L4\n  speculative: {{method: {word}}}\n"
    with pytest.raises(ManifestError) as err:
        load_manifest(text)
    assert err.value.problems == ["spec.speculative.method: must be one of off, ngram, draft_model (got False); "
                                  "YAML reads an unquoted off as false: quote it ('off')"]
    quoted = text.replace(f"method: {word}", "method: 'off'")
    assert load_manifest(quoted).spec.speculative.method == "off"


def test_a_boolean_where_no_choice_is_a_yaml_word_gets_no_hint():
    text = HEAD + "spec:\n  model: {source: hf://org/m}\n  gpu: L4\n  dtype: true\n"
    with pytest.raises(ManifestError) as err:
        load_manifest(text)
    assert err.value.problems == ["spec.dtype: must be one of bfloat16, float16, float32 (got True)"]
