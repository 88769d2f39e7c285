"""A self-signed serving certificate, made with the `openssl` command and kept in a directory so
a restarted server presents the same one (clients keep trusting it).

TLS is what lets kubectl authenticate: client-go applies a kubeconfig's credentials only to
https servers, so over plain http kubectl would never send the bearer token.
"""

from __future__ import annotations

import base64
import ipaddress
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path


class TlsUnavailable(Exception):
    """No certificate could be made (no `openssl` on PATH, or it failed)."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path

    def ca_data(self) -> str:
        """The certificate as a kubeconfig's certificate-authority-data (it is its own CA)."""
        return base64.b64encode(self.cert.read_bytes()).decode()

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def _san(hosts: list[str]) -> str:
    names = {"DNS:localhost", "IP:127.0.0.1"}
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            if host not in ("0.0.0.0", "::"):
                names.add(f"IP:{host}")
        except ValueError:
            names.add(f"DNS:{host}")
    return ",".join(sorted(names))


def ensure_certificate(directory: Path, hosts: list[str]) -> TlsFiles:
    """The certificate in `directory`, made there first if missing; raises TlsUnavailable."""
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "tls.crt", directory / "tls.key")
    if files.cert.exists() and files.key.exists():
        return files
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsUnavailable("the openssl command is not installed")
    cmd = [
        openssl,
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(files.key),
        "-out",
        str(files.cert),
        "-days",
        "3650",
        "-subj",
        "/CN=localcluster",
        "-addext",
        f"subjectAltName={_san(hosts)}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,digitalSignature,keyCertSign",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise TlsUnavailable(f"openssl failed: {result.stderr.strip()}")
    files.key.chmod(0o600)
    return files
