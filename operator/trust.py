"""What the operator trusts: which images build and serving pods may run, and which artifacts it serves.

Build pods hold the artifact store's write credentials and serving pods its read
credentials, so an LLMEngine may name only images the operator's admin allowed
(the chart's images, or an ``allowedImages`` entry; forms in
:mod:`kiln.operator.images`). Every artifact records who built it
(:class:`kiln.artifact_manifest.BuiltBy`: the builder image and this operator's
identity); the operator serves only artifacts it built with a trusted image, pins
the manifest's content digest when the build finishes (``status.artifact``), and
tells the serving pods exactly that build (``$KILN_EXPECT_ARTIFACT``) so they refuse
anything else. A store whose manifest later differs from the pin is not trusted:
the pin is never re-read from the store. Before any of that, a manifest must be signed
by the operator's own verify key, and its whole envelope must be the spec's (a version
carries the envelope's whole SHA-256; the comparison also catches a store rewrite): engines and adapters alike
(:func:`manifest_problem`). docs/operator-trust.md explains the whole model.
"""

from __future__ import annotations

from typing import Any

from kiln.operator.images import AllowEntry, image_allowed, parse_allow_entry, parse_image, repository_entry
from kiln.operator.settings import OperatorConfig

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import ArtifactExpectation, BuiltBy, Manifest
from kiln.envelope import envelope_mismatch
from kiln.signing import Verifier

ALLOWLIST_HINT = "the chart value allowedImages (KILN_ALLOWED_IMAGES)"


def allow_entries(config: OperatorConfig) -> list[AllowEntry]:
    """The chart's images (their repositories) and then the admin's allowlist."""
    return [repository_entry(config.builder_image), repository_entry(config.serving_image),
            *(parse_allow_entry(e) for e in config.allowed_images)]


def image_problem(field: str, image: str | None, config: OperatorConfig) -> str | None:
    """A user-facing message when ``image`` (an LLMEngine's override at ``field``) may not run; None if it may."""
    if image is None:
        return None
    try:
        parse_image(image)
    except ValueError as exc:
        return f"{field}: {image!r} is not an image reference ({exc}); fix it, or remove {field} to use the " \
               "chart's image"
    if image_allowed(image, allow_entries(config)):
        return None
    chart = sorted({repository_entry(config.builder_image).text, repository_entry(config.serving_image).text})
    listed = ", ".join(config.allowed_images) or "empty"
    return (f"{field}: {image} is not an image this operator may run (its pods get the artifact store's "
            f"credentials); allowed: the chart's {' and '.join(chart)} (any tag) and allowedImages ({listed}). "
            f"Remove {field} to use the chart's image, or ask the operator's admin to add it to {ALLOWLIST_HINT}")


def spec_image_problem(spec: LLMEngineSpec, config: OperatorConfig) -> str | None:
    return (image_problem("spec.build.image", spec.build.image, config)
            or image_problem("spec.serving.image", spec.serving.image, config))


def builder_image(spec: LLMEngineSpec, config: OperatorConfig) -> str:
    return spec.build.image or config.builder_image


def serving_image(spec: LLMEngineSpec, config: OperatorConfig) -> str:
    return spec.serving.image or config.serving_image


def built_by(spec: LLMEngineSpec, config: OperatorConfig) -> BuiltBy:
    """What a build Job of ``spec`` records in its artifact (``$KILN_BUILT_BY``)."""
    return BuiltBy.of(builder_image(spec, config), config.operator_id)


def artifact_problem(manifest: Manifest, config: OperatorConfig) -> str | None:
    """Why this operator will not serve ``manifest``'s artifact; None when it trusts it."""
    got = manifest.built_by
    if got is None:
        return ("its manifest records no builder (published outside an operator, e.g. by `kiln build` by hand "
                "or by a kiln without build provenance)")
    if got.operator != config.operator_id:
        return (f"it was built through operator {got.operator!r}, not this one ({config.operator_id!r}; chart "
                "value operatorId)")
    if not image_allowed(got.builder_image, allow_entries(config)):
        return (f"it was built by image {got.builder_image}, which this operator does not trust (the chart's "
                f"images and {ALLOWLIST_HINT})")
    return None


def pinned_digest(status: dict[str, Any], version: str) -> str | None:
    """The content digest this engine pinned for ``version``: ``status.artifact`` when it is that version's
    (absent while it is being built: the build's output is pinned when it appears), else the history's
    entry of a version served before (a GitOps revert). None: never pinned; the first trusted read pins."""
    artifact = status.get("artifact") or {}
    if artifact.get("engineVersion") == version:
        return artifact.get("contentDigest")
    entry = next((e for e in status.get("history") or [] if e.get("engineVersion") == version), {})
    return entry.get("contentDigest")


def pin_problem(manifest: Manifest, pinned: str | None, where: str = "status.artifact.contentDigest") -> str | None:
    """Why the store's manifest is not the build this engine pinned (at ``where``); None when it is (or nothing
    is pinned)."""
    if pinned is None or manifest.content_digest == pinned:
        return None
    return (f"its manifest changed after this operator pinned the build (content digest "
            f"{manifest.content_digest[:19]}..., pinned {pinned[:19]}...: {where})")


def signature_problem(document: dict[str, Any] | None, verify_pem: bytes) -> str | None:
    """Why a manifest as stored is not signed by the operator's verify key; None when it is."""
    problem = Verifier.from_pem_data(verify_pem, "the operator's verify key (signing.secretName)").problem(
        document or {})
    return None if problem is None else f"{problem}; this operator serves only what its own key signed"


def manifest_problem(manifest: Manifest, document: dict[str, Any] | None, *, verify_pem: bytes,
                     config: OperatorConfig, envelope: dict[str, Any], pinned: str | None,
                     pinned_at: str = "status.artifact.contentDigest") -> str | None:
    """Why this operator will neither serve nor pin a manifest read from the store; None when it trusts it.
    The signature first (nothing the manifest says is believed before it), then who built it, the pin, and the
    whole envelope against ``envelope`` (what the spec hashes), so a rewritten manifest under the version is caught."""
    return (signature_problem(document, verify_pem) or artifact_problem(manifest, config)
            or pin_problem(manifest, pinned, pinned_at) or envelope_mismatch(manifest.envelope, envelope))


def expectation(manifest: Manifest, pinned: str | None = None) -> ArtifactExpectation:
    """What serving pods must find in the manifest: the pinned build (or, at first sight, this one)."""
    assert manifest.built_by is not None
    return ArtifactExpectation(built_by=manifest.built_by, content_digest=pinned or manifest.content_digest)
