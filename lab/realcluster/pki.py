"""The control plane's key material, made with the `openssl` command into its directory: a CA, the
API server's serving certificate signed by it (loopback names only), and the key pair that signs
and verifies ServiceAccount tokens."""

from __future__ import annotations

import base64
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAMES = "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:127.0.0.1"


class PkiFailed(RuntimeError):
    """openssl is missing or refused; the message carries its error."""


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    sa_key: Path
    sa_pub: Path

    def ca_data(self) -> str:
        """The CA as a kubeconfig's certificate-authority-data."""
        return base64.b64encode(self.ca_cert.read_bytes()).decode()


def _openssl(*args: str, stdin: str | None = None) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PkiFailed("the openssl command is not installed")
    result = subprocess.run([openssl, *args], input=stdin, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PkiFailed(f"openssl {args[0]} failed: {result.stderr.strip()}")


def make(directory: Path) -> Pki:
    """Everything in `directory` (made if missing, kept if there: a restarted server keeps its CA)."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    pki = Pki(d / "ca.crt", d / "ca.key", d / "apiserver.crt", d / "apiserver.key", d / "sa.key", d / "sa.pub")
    if all(p.exists() for p in (pki.ca_cert, pki.server_cert, pki.sa_key, pki.sa_pub)):
        return pki
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        str(pki.ca_key),
        "-out",
        str(pki.ca_cert),
        "-days",
        "3650",
        "-subj",
        "/CN=k8s-dispatch-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,digitalSignature,keyCertSign",
    )
    csr = d / "apiserver.csr"
    _openssl("req", *ec, "-keyout", str(pki.server_key), "-out", str(csr), "-subj", "/CN=kube-apiserver")
    ext = d / "apiserver.ext"
    ext.write_text(
        f"subjectAltName={SERVER_NAMES}\nextendedKeyUsage=serverAuth\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(pki.ca_cert),
        "-CAkey",
        str(pki.ca_key),
        "-CAcreateserial",
        "-out",
        str(pki.server_cert),
        "-days",
        "3650",
        "-extfile",
        str(ext),
    )
    # ServiceAccount tokens are signed with RSA (RS256), which every client verifies.
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki.sa_key))
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))
    for key in (pki.ca_key, pki.server_key, pki.sa_key):
        key.chmod(0o600)
    return pki


def client_cert(pki: Pki, name: str, *, common_name: str, organization: str = "") -> tuple[Path, Path]:
    """A client certificate `name`.crt/.key beside the CA, signed by it (kept if there): what
    kube-apiserver shows the kubelet when it forwards `pods/log`, exec or port-forward."""
    d = pki.ca_cert.parent
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    if cert.exists() and key.exists():
        return cert, key
    subject = f"/CN={common_name}" + (f"/O={organization}" if organization else "")
    csr, ext = d / f"{name}.csr", d / f"{name}.ext"
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", subject)  # fmt: skip
    ext.write_text("extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "3650", "-extfile", str(ext))  # fmt: skip
    key.chmod(0o600)
    return cert, key
