"""The local cluster's certificates: one CA, the apiserver's serving certificate, a client certificate per
component, and the service-account signing key, written once under the cluster's folder."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICE_IP = "10.96.0.1"  # the first address of the cluster's service range: the `kubernetes` Service
APISERVER_NAMES = ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                   "kubernetes.default.svc.cluster.local", "localhost"]
# Who each component is, as the apiserver's authorizers see it (CN = user, O = groups).
CLIENTS = {
    "admin": ("kiln-admin", ["system:masters"]),
    "controller-manager": ("system:kube-controller-manager", []),
    "scheduler": ("system:kube-scheduler", []),
    "lws": ("kiln-lws-controller", ["system:masters"]),
}
_DAYS = 365


@dataclass(frozen=True)
class Pki:
    root: Path

    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def ca(self) -> Path:
        return self.path("ca.crt")

    def client(self, who: str) -> tuple[Path, Path]:
        return self.path(f"{who}.crt"), self.path(f"{who}.key")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(cn: str, orgs: list[str] | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs or []]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def sign(subject: x509.Name, key, ca_cert: x509.Certificate | None, ca_key, *, is_ca: bool = False,
          usage: list | None = None, sans: list | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(ca_cert.subject if ca_cert else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=_DAYS))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    return builder.sign(ca_key, hashes.SHA256())


def write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(pki: Pki):
    ca_key = serialization.load_pem_private_key(pki.path("ca.key").read_bytes(), None)
    return x509.load_pem_x509_certificate(pki.ca.read_bytes()), ca_key


def serving_cert(pki: Pki, name: str, ips: list[str], dns: list[str] | None = None) -> tuple[Path, Path]:
    """A serving certificate signed by the cluster's CA for ``ips`` (and ``dns``): (cert, key) paths."""
    ca, ca_key = _load_ca(pki)
    sans = [x509.DNSName(n) for n in dns or []] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    key = _key()
    crt, keyfile = pki.path(f"{name}.crt"), pki.path(f"{name}.key")
    write_key(keyfile, key)
    write_cert(crt, sign(_name(name), key, ca, ca_key, usage=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans))
    return crt, keyfile


def ensure_pki(root: Path, node_name: str, host_ip: str) -> Pki:
    """The CA, client identities and service-account key are made once (a second `make cluster` keeps
    them); the apiserver's serving certificate is made anew for the address it listens on now."""
    pki = Pki(root)
    if not pki.ca.exists():
        _new_identities(pki, node_name)
    serving_cert(pki, "apiserver", ["127.0.0.1", SERVICE_IP, host_ip], APISERVER_NAMES)
    return pki


def _new_identities(pki: Pki, node_name: str) -> None:
    pki.root.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = sign(_name("kiln-local-ca"), ca_key, None, ca_key, is_ca=True)
    write_key(pki.path("ca.key"), ca_key)
    write_cert(pki.ca, ca)
    clients = dict(CLIENTS, node=(f"system:node:{node_name}", ["system:nodes"]))
    for who, (cn, orgs) in clients.items():
        key = _key()
        crt, keyfile = pki.client(who)
        write_key(keyfile, key)
        write_cert(crt, sign(_name(cn, orgs), key, ca, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_key(pki.path("sa.key"), sa)
    pki.path("sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def kubeconfig(pki: Pki, who: str, server: str) -> str:
    """A kubeconfig for one component (YAML text, files referenced by absolute path)."""
    crt, key = pki.client(who)
    return (f"apiVersion: v1\nkind: Config\nclusters:\n- name: kiln-local\n  cluster:\n"
            f"    server: {server}\n    certificate-authority: {pki.ca}\nusers:\n- name: {who}\n  user:\n"
            f"    client-certificate: {crt}\n    client-key: {key}\ncontexts:\n- name: kiln-local\n"
            f"  context: {{cluster: kiln-local, user: {who}}}\ncurrent-context: kiln-local\n")
