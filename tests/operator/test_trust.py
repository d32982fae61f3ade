"""What the operator trusts: the image allowlist, LLMEngine names, and artifact provenance (pure functions)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from kiln.operator.images import parse_allow_entry, parse_image
from kiln.operator.naming import MAX_NAME, engine_name_problem
from kiln.operator.settings import ConfigError, OperatorConfig
from kiln.operator.trust import artifact_problem, built_by, expectation
from kiln.operator.validation import InvalidSpec, validate_name, validate_spec

from kiln.artifact_manifest import ArtifactExpectation, BuiltBy, Manifest, ManifestFile

CHART = "ghcr.io/kiln-dev/kiln:0.1.0"
DIGEST = "sha256:" + "a" * 64
CFG = OperatorConfig(store_uri="s3://b/p", builder_image=CHART, serving_image=CHART, operator_id="kiln-system/kiln",
                     allowed_images=("registry.example.com/team-a/*", "quay.io/org/builder:2.0",
                                     f"docker.io/org/pinned@{DIGEST}", "nvcr.io/nvidia/kiln"))
BASE = {"model": {"source": "hf://o/m"}, "gpu": "cpu"}


def test_references_normalize_like_a_container_runtime():
    assert parse_image("nginx") == parse_image("docker.io/library/nginx")
    assert parse_image("nginx").effective_tag == "latest"
    assert parse_image("org/app:1").repository == "docker.io/org/app"
    ref = parse_image(f"localhost:5000/a/b:v1@{DIGEST}")
    assert (ref.repository, ref.tag, ref.digest) == ("localhost:5000/a/b", "v1", DIGEST)
    for bad in ("", "UPPER/case", "a b", "x@sha256:short", "reg.io/a:bad tag", " nginx"):
        with pytest.raises(ValueError):
            parse_image(bad)
    for bad in ("*", "reg.io/*/x", "reg.io/a*"):
        with pytest.raises(ValueError, match=r"\*"):
            parse_allow_entry(bad)


@pytest.mark.parametrize("image", [
    CHART, "ghcr.io/kiln-dev/kiln:0.2.0", f"ghcr.io/kiln-dev/kiln@{DIGEST}",  # the chart's repository
    "registry.example.com/team-a/builder:1", "registry.example.com/team-a/sub/x@" + DIGEST,  # prefix
    "quay.io/org/builder:2.0", f"quay.io/org/builder@{DIGEST}", f"quay.io/org/builder:2.0@{DIGEST}",  # tag + pins
    f"org/pinned@{DIGEST}",  # exact digest, Docker Hub spelled short
    "nvcr.io/nvidia/kiln:anything",  # a whole repository
])
def test_allowed_images_pass(image: str):
    spec = validate_spec({**BASE, "build": {"image": image}, "serving": {"image": image}}, CFG)
    assert spec.build.image == image


@pytest.mark.parametrize("image", [
    "evil.io/kiln:0.1.0",  # another registry
    "ghcr.io/kiln-dev/kiln-fork:0.1.0",  # a sibling repository of the chart's
    "registry.example.com/team-b/builder:1", "registry.example.com/team-a",  # outside the prefix
    "quay.io/org/builder:2.1", "quay.io/org/builder",  # another tag; the implicit :latest
    "org/pinned:latest", f"org/pinned@sha256:{'b' * 64}",  # not the listed digest
])
@pytest.mark.parametrize("field", ["build", "serving"])
def test_other_images_fail_naming_the_field_and_the_fix(image: str, field: str):
    with pytest.raises(InvalidSpec) as err:
        validate_spec({**BASE, field: {"image": image}}, CFG)
    msg = str(err.value)
    assert msg.startswith(f"spec.{field}.image: {image} is not an image this operator may run")
    assert "allowedImages" in msg and "ghcr.io/kiln-dev/kiln" in msg and f"Remove spec.{field}.image" in msg


def test_by_default_only_the_charts_images_run():
    cfg = OperatorConfig(store_uri="s3://b/p", builder_image="reg.io/kiln-build:1", serving_image="reg.io/kiln:1")
    assert validate_spec({**BASE, "build": {"image": "reg.io/kiln-build:2"}, "serving": {"image": "reg.io/kiln:3"}},
                         cfg).build.image == "reg.io/kiln-build:2"
    with pytest.raises(InvalidSpec, match=r"allowedImages \(empty\)"):
        validate_spec({**BASE, "build": {"image": "reg.io/other:1"}}, cfg)
    with pytest.raises(InvalidSpec, match="spec.serving.image: 'Bad Image' is not an image reference"):
        validate_spec({**BASE, "serving": {"image": "Bad Image"}}, cfg)


def test_the_allowlist_setting_is_json_and_bad_entries_name_themselves():
    cfg = OperatorConfig.from_env({"KILN_ALLOWED_IMAGES": '["reg.io/team/*", "quay.io/o/b:1"]',
                                   "KILN_OPERATOR_ID": "ops/kiln"})
    assert cfg.allowed_images == ("reg.io/team/*", "quay.io/o/b:1") and cfg.operator_id == "ops/kiln"
    assert OperatorConfig.from_env({}).allowed_images == ()
    with pytest.raises(ConfigError, match=r"KILN_ALLOWED_IMAGES\[1\] 'reg\.io/\*/x'"):
        OperatorConfig.from_env({"KILN_ALLOWED_IMAGES": '["ok/img", "reg.io/*/x"]'})
    with pytest.raises(ConfigError, match="KILN_ALLOWED_IMAGES must be a JSON list"):
        OperatorConfig.from_env({"KILN_ALLOWED_IMAGES": '"reg.io/x"'})
    with pytest.raises(ConfigError, match="KILN_BUILDER_IMAGE"):
        OperatorConfig.from_env({"KILN_BUILDER_IMAGE": "Not An Image"})


@pytest.mark.parametrize("name, rule", [
    ("a" * (MAX_NAME + 1), f"at most {MAX_NAME}"),
    ("llama.chat", "DNS-1035"),
    ("chat-", "DNS-1035"),
])
def test_names_that_cannot_name_children_fail_on_metadata_name(name: str, rule: str):
    assert engine_name_problem(name) is not None
    with pytest.raises(InvalidSpec, match=rule) as err:
        validate_name(name)
    assert str(err.value).startswith(f"metadata.name: {name!r}")


@pytest.mark.parametrize("name", ["chat", "a" * MAX_NAME, "7b-chat", "x"])
def test_names_that_fit_pass(name: str):
    validate_name(name)


def manifest(by: BuiltBy | None) -> Manifest:
    files = [ManifestFile(path="engine.json", sha256="c" * 64, size=3)]
    return Manifest(engine_version="m-0123456789ab", created_at=datetime.now(UTC), upload_id="u", envelope={},
                    files=files, total_size=3, content_digest=Manifest.digest_of(files), built_by=by)


def test_the_operator_serves_only_artifacts_it_built_with_a_trusted_image():
    from kiln.api import LLMEngineSpec

    ours = built_by(LLMEngineSpec.model_validate(BASE), CFG)
    assert ours == BuiltBy(builder_image=CHART, operator="kiln-system/kiln")
    assert artifact_problem(manifest(ours), CFG) is None
    assert artifact_problem(manifest(BuiltBy.of("ghcr.io/kiln-dev/kiln:0.0.9", CFG.operator_id)), CFG) is None
    assert artifact_problem(manifest(BuiltBy.of("registry.example.com/team-a/b@" + DIGEST, CFG.operator_id)),
                            CFG) is None
    assert "records no builder" in artifact_problem(manifest(None), CFG)
    assert "operator 'other-ns/kiln'" in artifact_problem(manifest(BuiltBy.of(CHART, "other-ns/kiln")), CFG)
    assert "image evil.io/x:1" in artifact_problem(manifest(BuiltBy.of("evil.io/x:1", CFG.operator_id)), CFG)


def test_an_expectation_names_what_differs():
    ours = manifest(BuiltBy.of(f"ghcr.io/kiln-dev/kiln@{DIGEST}", "kiln-system/kiln"))
    expect = expectation(ours)
    assert expect.built_by.builder_image_digest == DIGEST and expect.content_digest == ours.content_digest
    assert expect.mismatch(ours) is None
    assert ArtifactExpectation.model_validate_json(expect.to_env()) == expect
    other = manifest(BuiltBy.of(f"ghcr.io/kiln-dev/kiln@{DIGEST}", "tenant-b/kiln"))
    assert expect.mismatch(other) == "manifest built_by.operator is 'tenant-b/kiln', the operator expected " \
                                     "'kiln-system/kiln'"
    assert "built_by.builder_image" in expect.mismatch(manifest(BuiltBy.of("evil.io/x:1", "kiln-system/kiln")))
    assert "records no builder" in expect.mismatch(manifest(None))
    replaced = ours.model_copy(update={"content_digest": "d" * 64})
    assert "content_digest" in expect.mismatch(replaced)
