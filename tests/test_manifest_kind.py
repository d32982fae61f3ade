"""A manifest is one kubectl applies: its ``kind`` and ``apiVersion`` are required and named with what to write,
and a GitOps file holding a pool and its members is rendered (and checked) whole, not by its first kind."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import cli
from kiln.manifest import ManifestError, load_manifest, load_pool

API = "serving.kiln.dev/v1alpha1"
MODEL = {"source": "hf://org/model", "revision": "a" * 40}
ENGINE = {"apiVersion": API, "kind": "LLMEngine", "metadata": {"name": "chat"},
          "spec": {"model": MODEL, "gpu": "cpu", "serving": {"pool": "cpu-pool"}}}
POOL = {"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "cpu-pool"}, "spec": {"gpu": "cpu"}}


def without(doc: dict, key: str) -> dict:
    return {k: v for k, v in doc.items() if k != key}


def run(command: str, tmp_path, *docs: dict):
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return CliRunner().invoke(cli, [command, "-f", str(path)], catch_exceptions=False)


@pytest.mark.parametrize("command", ["plan", "render"])
@pytest.mark.parametrize(("doc", "line"), [
    (without(ENGINE, "kind"), "kind: required field is missing; add kind: LLMEngine (a pool's manifest: kind: "
                              "LLMEnginePool)"),
    (without(ENGINE, "apiVersion"), f"apiVersion: required field is missing; add apiVersion: {API}"),
    ({**ENGINE, "apiVersion": "serving.kiln.dev/v1"}, f"apiVersion: must be one of {API} (got 'serving.kiln.dev/v1')"),
])
def test_a_manifest_without_its_kind_or_api_version_is_refused_naming_what_to_write(tmp_path, command, doc, line):
    result = run(command, tmp_path, doc)
    assert result.exit_code == 2, result.output
    assert line in result.stderr


def test_a_pool_manifest_without_its_api_version_is_refused():
    with pytest.raises(ManifestError, match=f"^apiVersion: required field is missing; add apiVersion: {API}$"):
        load_pool(without(POOL, "apiVersion"))
    with pytest.raises(ManifestError, match=r"^kind: required field is missing; add kind: LLMEngine \(a pool's "
                                            r"manifest: kind: LLMEnginePool\)$"):
        load_manifest(without(POOL, "kind"))  # one line: not the lines of an engine's spec it is not
    with pytest.raises(ManifestError, match="^kind: required field is missing; add kind: LLMEnginePool$"):
        load_pool(without(POOL, "kind"))


def test_a_file_with_a_pool_and_its_member_renders_both(tmp_path):
    from kiln.manifest import load_documents

    result = run("render", tmp_path, POOL, ENGINE)
    assert result.exit_code == 0, result.output
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc]
    assert kinds[:2] == ["ConfigMap", "Deployment"] and kinds[-1] == "Job"  # the pool's objects, then the member's
    assert [m.kind for m in load_documents(yaml.safe_dump_all([POOL, {"kind": "Secret"}, ENGINE]))] == [
        "LLMEnginePool", "LLMEngine"]


def test_each_kiln_document_of_a_file_is_checked_and_named(tmp_path):
    """The pool of a pool + member file was left out unread: a pool the API server refuses rendered as fine."""
    bad_pool = {**POOL, "spec": {"gpu": "cpu", "replicas": "2"}}
    result = run("render", tmp_path, bad_pool, ENGINE)
    assert result.exit_code == 2, result.output
    assert "LLMEnginePool cpu-pool: spec.replicas: must be an integer (got '2')" in result.stderr
    refused = {**POOL, "metadata": {"name": "9-pool"}}  # what only the operator's checks refuse, also named
    result = run("render", tmp_path, refused, ENGINE)
    assert result.exit_code == 2 and "LLMEnginePool 9-pool: metadata.name: '9-pool' must be a DNS-1035" in \
        result.stderr


def test_a_document_without_its_kind_in_a_file_is_named_not_left_out(tmp_path):
    """kubectl apply refuses the file; kiln render rendered the other documents and said nothing of it."""
    other = {**ENGINE, "metadata": {"name": "other"}}
    for broken, line in ((without(other, "kind"), "document other: kind: required field is missing"),
                         ({**other, "kind": "LLMEngin"}, "LLMEngin other: kind: must be one of LLMEngine")):
        result = run("render", tmp_path, POOL, ENGINE, broken)
        assert result.exit_code == 2 and line in result.stderr, result.output


@pytest.mark.parametrize("text", ["a: " + "[" * 3000, "x" * 300])
def test_text_too_deep_or_too_long_for_a_path_is_said_not_a_traceback(text):
    from kiln.manifest import load_documents

    with pytest.raises(ManifestError):
        load_documents(text)
    with pytest.raises(ManifestError) as info:
        load_manifest({**ENGINE, "spec": {**ENGINE["spec"], "maxBatchSize": "[" * 3000}})
    assert info.value.problems[0].startswith("spec.maxBatchSize: must be an integer")


@pytest.mark.parametrize(("labels", "line"), [
    ({"team": "ml team"}, "metadata.labels: value 'ml team' of team is not a label value"),
    ({"Example.com/team": "ml"}, "metadata.labels: key 'Example.com/team' is not a Kubernetes key"),
    ({"team": "a" * 64}, "metadata.labels: value 'aaaa"),
])
def test_labels_the_api_server_refuses_are_refused(labels, line):
    """The API server checks every object's labels: kiln plan planned an LLMEngine that kubectl apply refuses."""
    with pytest.raises(ManifestError) as info:
        load_manifest({**ENGINE, "metadata": {"name": "chat", "labels": labels}})
    assert info.value.problems[0].startswith(line)
    fine = {"app.kubernetes.io/name": "kiln", "tier": "", "v": "1.0_b-2"}
    annotations = {"kubectl.kubernetes.io/last-applied-configuration": "{\"any\": \"text at all\"}"}
    assert load_manifest({**ENGINE, "metadata": {"name": "chat", "labels": fine, "annotations": annotations}})
