"""The Job the operator renders runs this builder: each container's command with that container's env only.

The pod is simulated faithfully enough to catch a broken contract: every volume is a
host directory that the containers mounting it share (``work``) or do not (each has
its own ``/tmp``), env comes from the container's ``env`` and its ``envFrom`` Secrets
and nothing else (no inherited variables), and ``$(VAR)`` in args is expanded as the
kubelet does. The fetch init container holds the model's credentials and no store
settings; the build container holds the store's and no model's, and still builds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from kiln.operator.keys import BUILD_KEY_SECRET as SIGNING_SECRET
from kiln.operator.keys import credentials_copy_name

from kiln.artifact_manifest import BUILT_BY_ENV, BuiltBy
from kiln.artifacts import ArtifactStore
from kiln.envelope import engine_version
from kiln.manifest import load_manifest
from kiln.signing import Verifier, new_key_pair_pem

OPERATOR_ID = "kiln-system/kiln"


def volume_dirs(container: dict, pod: Path) -> dict[str, Path]:
    """Host directory of each volume the container mounts; a volume mounted inside another (the PVC inside the
    work dir) lives at that place inside the other's directory, as a bind mount would show it."""
    dirs: dict[str, Path] = {}
    mounts = sorted(container["volumeMounts"], key=lambda m: len(m["mountPath"]))
    for m in mounts:
        parent = next((p for p in reversed(mounts) if m["mountPath"].startswith(p["mountPath"] + "/")), None)
        dirs[m["name"]] = (dirs[parent["name"]] / m["mountPath"][len(parent["mountPath"]) + 1:] if parent
                           else pod / "volumes" / m["name"])
    return dirs


def container_env(container: dict, secrets: dict[str, dict[str, str]], pod: Path) -> dict[str, str]:
    """What the kubelet gives the container: envFrom Secrets, then env (which wins); a path under a mount
    becomes the same path under that volume's host directory (shared by every container mounting it)."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom") or []:
        env.update(secrets[ref["secretRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container["env"]})
    dirs = volume_dirs(container, pod)
    mounts = sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    for name, value in env.items():
        for m in mounts:
            if value == m["mountPath"] or value.startswith(m["mountPath"] + "/"):
                env[name] = str(dirs[m["name"]]) + value[len(m["mountPath"]):]
                break
    return env


def mount_secret_volumes(container: dict, pod_spec: dict, secrets: dict[str, dict[str, str]], pod: Path) -> None:
    """The files of each Secret volume the container mounts, as the kubelet projects them."""
    by_name = {v["name"]: v["secret"] for v in pod_spec.get("volumes") or [] if "secret" in v}
    for name, path in volume_dirs(container, pod).items():
        if name in by_name:
            path.mkdir(parents=True, exist_ok=True)
            for key, value in secrets[by_name[name]["secretName"]].items():
                (path / key).write_text(value)


def run_container(container: dict, secrets: dict[str, dict[str, str]], pod: Path) -> subprocess.CompletedProcess:
    env = container_env(container, secrets, pod)
    for path in volume_dirs(container, pod).values():
        path.mkdir(parents=True, exist_ok=True)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    assert container["command"][0] == "kiln"
    termination_log = pod / f"{container['name']}-termination-log"
    proc_env = {**env, "PATH": "/usr/bin:/bin", "KILN_TERMINATION_LOG": str(termination_log),
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-P", "-m", "kiln", *container["command"][1:], *args], env=proc_env,
                          cwd=pod, capture_output=True, text=True, timeout=600)


@pytest.fixture
def models_bucket(s3_bucket: str, s3_endpoint: str, toy_model) -> str:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for f in toy_model("llama-tiny").iterdir():
        s3.upload_file(str(f), s3_bucket, f"models/tiny/{f.name}")
    return s3_bucket


# The pvc source differs from s3 only in where the fetch reads (the claim, mounted in both containers); the build
# half it then runs is the s3 case's: slow (make test-slow), to keep make test's time.
@pytest.mark.parametrize("source_kind", ["s3", pytest.param("pvc", marks=pytest.mark.slow)])
def test_each_container_of_the_rendered_build_job_does_its_half_with_only_its_credentials(
        source_kind: str, toy_model, s3_endpoint: str, s3_bucket: str, tmp_path: Path, request):
    from kiln.operator.jobs import PVC_MOUNT_ROOT, build_job
    from kiln.operator.settings import OperatorConfig

    pod = tmp_path / "pod"
    model: dict = {"source": "pvc://models-claim/tiny"}
    if source_kind == "s3":
        bucket = request.getfixturevalue("models_bucket")
        model = {"source": f"s3://{bucket}/models/tiny", "credentialsSecret": "team-models"}
    engine = load_manifest({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "tiny"},
        "spec": {"model": model, "gpu": "cpu", "dtype": "float32",
                 "maxBatchSize": 4, "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128},
    })
    version = engine_version(engine.spec)
    store_uri = f"s3://{s3_bucket}/store"
    config = OperatorConfig(store_uri=store_uri, store_secret="kiln-store", operator_id=OPERATOR_ID)
    job = build_job(engine.spec, "tiny", "default", version, config)
    pod_spec = job["spec"]["template"]["spec"]
    (fetch,), (build,) = pod_spec["initContainers"], pod_spec["containers"]
    if source_kind == "pvc":  # the claim's files, where both containers mount it
        assert any(m["mountPath"] == f"{PVC_MOUNT_ROOT}/models-claim" for m in fetch["volumeMounts"])
        assert volume_dirs(fetch, pod)["model"] == volume_dirs(build, pod)["model"]
        shutil.copytree(toy_model("llama-tiny"), volume_dirs(fetch, pod)["model"] / "tiny")

    aws = {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": s3_endpoint}
    # The Job runs in the jobs namespace, where the operator copies the engine namespace's Secret (operator.keys).
    model_secret = {"AWS_ACCESS_KEY_ID": "team-a-model-reader", "AWS_SECRET_ACCESS_KEY": "model-s3cret", **aws}
    secrets = {credentials_copy_name("default", "team-models"): model_secret,
               "kiln-store": {"AWS_ACCESS_KEY_ID": "kiln-store-writer", "AWS_SECRET_ACCESS_KEY": "store-s3cret",
                              **aws}}
    private_pem, public_pem = new_key_pair_pem()
    secrets[SIGNING_SECRET] = {"signing-key.pem": private_pem.decode()}
    for where in (pod, tmp_path / "empty-pod"):
        mount_secret_volumes(build, pod_spec, secrets, where)
    fetch_env = container_env(fetch, secrets, pod)
    build_env = container_env(build, secrets, pod)
    assert not {"store-s3cret", "kiln-store-writer", store_uri} & set(fetch_env.values())
    assert not {"model-s3cret", "team-a-model-reader"} & set(build_env.values())
    assert BUILT_BY_ENV not in fetch_env and BuiltBy.model_validate_json(build_env[BUILT_BY_ENV]).operator == OPERATOR_ID
    assert "KILN_SIGNING_KEY" not in fetch_env and "KILN_SIGNING_KEY" in build_env  # the key: publishing half only

    # The build half alone has nothing to build from, and says what to run first.
    early = run_container(build, secrets, tmp_path / "empty-pod")
    assert early.returncode == 2 and "kiln build --fetch-only" in early.stderr, early.stderr

    fetched = run_container(fetch, secrets, pod)
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout.startswith(f"fetched: {model['source']}"), fetched.stdout
    if source_kind == "s3":  # the build cannot go back to the source (it has no credentials for it anyway)
        s3 = boto3.client("s3", endpoint_url=s3_endpoint)
        for obj in s3.list_objects_v2(Bucket=bucket, Prefix="models/")["Contents"]:
            s3.delete_object(Bucket=bucket, Key=obj["Key"])

    built = run_container(build, secrets, pod)
    assert built.returncode == 0, built.stderr
    assert f"built: {version}" in built.stdout
    manifest, document = ArtifactStore.from_uri(store_uri).read_signed_manifest(version)
    assert manifest is not None
    (pod / "verify-key.pem").write_bytes(public_pem)
    assert Verifier.from_pem(pod / "verify-key.pem").problem(document) is None
    assert manifest.built_by == BuiltBy(builder_image=config.builder_image, operator=OPERATOR_ID)
    assert version in (pod / "build-termination-log").read_text()
