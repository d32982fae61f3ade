"""The real-cluster suite's fixtures: one control plane for the whole session (built by cluster/build.sh,
cached, started by kiln_cluster under .kiln-work/cluster-test), kiln installed into it with helm exactly as
docs/local-cluster.md tells a user, and the SmolLM2 GGUF in the cluster's S3."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from clusterlib import GROUP, ROOT, Kube, secret, store_env

sys.path.insert(0, str(ROOT / "examples"))
from smollm2 import GGUF_NAME, ensure_gguf  # noqa: E402

TEST_ROOT = ROOT / ".kiln-work" / "cluster-test"
OPERATOR_NS = "kiln-system"
ENGINE_NS = "kiln-e2e"
MODELS_BUCKET = "models"
SMOLLM2_KEY = f"smollm2/{GGUF_NAME}"


@pytest.fixture(scope="session")
def cluster() -> Iterator[Kube]:
    from kiln_cluster import control_plane

    control_plane.down(TEST_ROOT, quiet=True)  # a cluster a killed run left, and its data: start afresh
    shutil.rmtree(TEST_ROOT, ignore_errors=True)
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/local/go/bin"}  # as make cluster-bins
    subprocess.run(["bash", str(ROOT / "cluster" / "build.sh"), str(TEST_ROOT / "bin")], check=True, env=env)
    c = control_plane.up(TEST_ROOT)
    try:
        yield Kube(bin=TEST_ROOT / "bin", kubeconfig=c.kubeconfig, s3_endpoint=c.s3_endpoint,
                   node_root=TEST_ROOT / "node")
    finally:
        control_plane.down(TEST_ROOT)


@pytest.fixture(scope="session")
def smollm2_s3(cluster: Kube) -> tuple[str, str]:
    """The SmolLM2 GGUF as an object of the cluster's S3: (s3 URI, sha256)."""
    path = ensure_gguf(quiet=True)
    s3 = cluster.s3()
    for bucket in (MODELS_BUCKET, "kiln-artifacts"):
        s3.create_bucket(Bucket=bucket)
    s3.upload_file(str(path), MODELS_BUCKET, SMOLLM2_KEY)
    return f"s3://{MODELS_BUCKET}/{SMOLLM2_KEY}", hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tiny_s3(cluster: Kube, smollm2_s3, tmp_path_factory) -> str:
    """A two-layer random-weight Llama checkpoint directory in the cluster's S3 (builds in seconds)."""
    from kiln.engine.random_checkpoint import make_random_model

    out = make_random_model(tmp_path_factory.mktemp("tiny"), "llama-tiny", seed=3)
    s3 = cluster.s3()
    for path in out.iterdir():
        s3.upload_file(str(path), MODELS_BUCKET, f"tiny/{path.name}")
    return f"s3://{MODELS_BUCKET}/tiny"


@pytest.fixture(scope="session")
def tiny_adapter_s3(cluster: Kube, tiny_s3, tmp_path_factory) -> str:
    """A rank-8 LoRA adapter (q_proj, v_proj; random, so it changes greedy answers) of the :func:`tiny_s3`
    model, made with peft, in the cluster's S3."""
    import torch
    from kiln.engine.random_checkpoint import make_random_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = make_random_model(tmp_path_factory.mktemp("tiny-base"), "llama-tiny", seed=3)  # tiny_s3's
    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    out = tmp_path_factory.mktemp("tiny-adapter")
    model.save_pretrained(out)
    for path in out.iterdir():
        cluster.s3().upload_file(str(path), MODELS_BUCKET, f"tiny-adapter/{path.name}")
    return f"s3://{MODELS_BUCKET}/tiny-adapter"


def build_jobs_of(kube: Kube, name: str, ns: str = ENGINE_NS) -> list[dict]:
    """The build Jobs an engine asked for: they run where builds run (the operator's namespace, which holds the
    signing key; docs/operator-trust.md), owned by no engine, marked with the engine they build for."""
    return [j for j in kube.jobs(OPERATOR_NS)
            if (j["metadata"].get("annotations") or {}).get(f"{GROUP}/requested-by") == f"{ns}/{name}"]


def engine_manifest(name: str, source: str, revision: str | None = None, **spec) -> dict:
    """An LLMEngine in the suite's namespace, sized for a 2-core machine."""
    model = {"source": source, "credentialsSecret": "models", **({"revision": revision} if revision else {})}
    return {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine",
            "metadata": {"name": name, "namespace": ENGINE_NS},
            "spec": {"model": model, "gpu": "cpu", "dtype": "float32", "maxBatchSize": 4, "maxInputLen": 256,
                     "maxSeqLen": 512, "maxNumTokens": 256, **spec}}


@pytest.fixture(scope="session")
def installed(cluster: Kube, smollm2_s3) -> Kube:
    """kiln as docs/local-cluster.md installs it: the CRDs server-side, the store Secrets, helm install."""
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/llmengines.serving.kiln.dev")
    env = store_env(cluster.s3_endpoint)
    for ns in (OPERATOR_NS, ENGINE_NS):
        cluster.kubectl("create", "namespace", ns)
        cluster.apply([secret("kiln-store", ns, env), secret("kiln-store-read", ns, env),
                       secret("models", ns, env)])
    cluster.helm("install", "kiln", str(ROOT / "helm" / "kiln"), "-n", OPERATOR_NS,
                 "-f", str(ROOT / "examples" / "local-cluster" / "values.yaml"), "--wait", "--timeout", "5m")
    return cluster
