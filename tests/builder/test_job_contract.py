"""The Job the operator renders runs this builder: env, args and a pvc:// source, as Kubernetes would pass them."""

from __future__ import annotations

import re
import shutil

from click.testing import CliRunner

from kiln.artifacts import ArtifactStore
from kiln.envelope import engine_version
from kiln.manifest import load_manifest


def test_operator_rendered_build_job_publishes_the_operators_version(toy_model, tmp_path):
    from kiln.builder.cli import build
    from kiln.operator.jobs import PVC_MOUNT_ROOT, WORK_DIR, build_job
    from kiln.operator.settings import OperatorConfig

    pod_root = tmp_path / "pod"  # stands in for the pod's filesystem: /var/lib/kiln -> <pod_root>/var/lib/kiln
    claim_dir = pod_root / PVC_MOUNT_ROOT.lstrip("/") / "models-claim"
    shutil.copytree(toy_model("llama-tiny"), claim_dir / "tiny")
    engine = load_manifest({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "tiny"},
        "spec": {"model": {"source": "pvc://models-claim/tiny"}, "gpu": "cpu", "dtype": "float32",
                 "maxBatchSize": 4, "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128},
    })
    version = engine_version(engine.spec)
    store_uri = f"file://{tmp_path / 'store'}"
    job = build_job(engine.spec, "tiny", "default", version, OperatorConfig(store_uri=store_uri))
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kiln", "build"]

    env = {e["name"]: e["value"] for e in container["env"]}
    for name in ("KILN_WORK_DIR", "KILN_PVC_ROOT", "HF_HOME"):
        assert env[name].startswith(WORK_DIR)
        env[name] = str(pod_root) + env[name]
    env["HOME"] = str(tmp_path)
    env["KILN_TERMINATION_LOG"] = str(tmp_path / "termination-log")
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]

    result = CliRunner().invoke(build, args, env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"built: {version}" in result.output
    assert ArtifactStore.from_uri(store_uri).exists(version)
    assert version in (tmp_path / "termination-log").read_text()
