"""What the real-cluster suite does to a cluster: kubectl and helm as a user runs them, waits on objects,
and the store's S3 bucket. Nothing here talks to the emulator: every call goes to the local apiserver."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

ROOT = Path(__file__).resolve().parents[2]
GROUP = "serving.kiln.dev"


class KubectlError(RuntimeError):
    def __init__(self, args: tuple[str, ...], stderr: str) -> None:
        super().__init__(f"kubectl {' '.join(args)}: {stderr}")
        self.stderr = stderr


@dataclass
class Kube:
    bin: Path
    kubeconfig: Path
    s3_endpoint: str
    node_root: Path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        done = subprocess.run([str(self.bin / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=180)
        if check and done.returncode != 0:
            raise KubectlError(args, done.stderr.strip())
        return done.stdout

    def helm(self, *args: str) -> str:
        done = subprocess.run([str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def get(self, kind: str, name: str | None = None, ns: str | None = None, selector: str | None = None) -> Any:
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        args += ["-n", ns] if ns else []
        args += ["-l", selector] if selector else []
        out = self.kubectl(*args, check=False)
        if not out:
            return None
        data = json.loads(out)
        return data["items"] if "items" in data else data

    def apply(self, obj: dict | list[dict], *extra: str) -> str:
        docs = obj if isinstance(obj, list) else [obj]
        return self.kubectl("apply", *extra, "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))

    def wait_for(self, what: str, check, timeout: float = 300, every: float = 1.0) -> Any:
        """Poll ``check()`` until it returns something truthy; fail naming ``what`` and the last value."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")

    def condition(self, obj: dict | None, kind: str) -> dict:
        for c in ((obj or {}).get("status") or {}).get("conditions") or []:
            if c["type"] == kind:
                return c
        return {}

    def engine(self, name: str, ns: str) -> dict | None:
        return self.get(f"llmengines.{GROUP}", name, ns)

    def jobs(self, ns: str) -> list[dict]:
        return self.get("jobs", ns=ns) or []

    def pod_logs(self, pod: dict) -> str:
        """A pod's container logs, read where the node agent writes them (no kubelet API serves them)."""
        logs = self.node_root / "pods" / pod["metadata"]["uid"] / "logs"
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))) if logs.is_dir() else ""

    def s3(self):
        return boto3.client("s3", endpoint_url=self.s3_endpoint, aws_access_key_id="kiln-local",
                            aws_secret_access_key="kiln-local", region_name="us-east-1")


def secret(name: str, ns: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
            "type": "Opaque", "stringData": data}


def store_env(endpoint: str) -> dict[str, str]:
    """The store Secrets' keys: moto accepts any key pair; the endpoint is the cluster's S3."""
    return {"AWS_ACCESS_KEY_ID": "kiln-local", "AWS_SECRET_ACCESS_KEY": "kiln-local",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint}


def endpoint_addresses(kube: Kube, service: str, ns: str) -> list[tuple[str, int]]:
    """The ready addresses of a Service, from its EndpointSlices (what a kube-proxy would route to)."""
    out = []
    for es in kube.get("endpointslices", ns=ns, selector=f"kubernetes.io/service-name={service}") or []:
        port = (es.get("ports") or [{}])[0].get("port")
        for ep in es.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready"):
                out += [(a, port) for a in ep["addresses"]]
    return out
