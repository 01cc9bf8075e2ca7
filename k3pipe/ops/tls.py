"""The team stack's TLS: a certificate authority of its own and the certificate MLflow and Prefect serve.

A stack reached beyond loopback carries the stack's password (basic auth) and every run's data: over
plain HTTP anyone on the path reads both. The stack makes a small CA once (``stack/tls/ca.pem``, its
key ``ca-key.pem`` mode 0600), and from it the servers' certificate (``server.pem``, key
``server-key.pem`` mode 0600) for the names and addresses clients use to reach it. A client trusts
the CA, not a public one: copy ``ca.pem`` to each node and point Prefect (``PREFECT_API_SSL_CERT_FILE``)
and MLflow (``MLFLOW_TRACKING_SERVER_CERT_PATH``) at it, as ``k3pipe stack env`` does.

The CA is kept across ``up``s (nodes keep trusting it); the server's certificate is made again when
the names it must carry change, when it is not the CA's, or when it has less than 30 days left.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from k3pipe.core.errors import StackError

__all__ = ["TlsFiles", "describe", "ensure_certificates", "san_names"]

CA_DAYS = 3650
SERVER_DAYS = 397
RENEW_BEFORE_DAYS = 30


@dataclass(frozen=True)
class TlsFiles:
    """Where the stack's CA and its servers' certificate and key are."""

    directory: Path

    @property
    def ca(self) -> Path:
        """The CA's certificate: what clients trust (not secret)."""
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca-key.pem"

    @property
    def cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def key(self) -> Path:
        return self.directory / "server-key.pem"


def _parse(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _key_text(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write a private key, mode 0600 from its first byte (never world-readable, even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tmp.chmod(0o644)
    tmp.replace(path)


def _load_ca(files: TlsFiles) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
        key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise StackError(
            f"the stack's CA in {files.directory} (ca.pem, ca-key.pem) is unreadable ({exc}); move the "
            "directory away to have a new CA made, then copy the new ca.pem to every node"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise StackError(f"{files.ca_key} is not the EC key the stack makes; move {files.directory} away")
    return cert, key


def _make_ca(files: TlsFiles, now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "k3pipe stack CA")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    usage = x509.KeyUsage(
        digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _key_text(files.ca_key, key)
    _write_cert(files.ca, cert)
    return cert, key


def _sans(cert: x509.Certificate) -> set[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in ext.get_values_for_type(x509.DNSName)} | {
        str(a) for a in ext.get_values_for_type(x509.IPAddress)
    }


def _current(files: TlsFiles, ca: x509.Certificate, names: list[str], now: dt.datetime) -> bool:
    """Whether the server's certificate is the CA's, carries exactly ``names`` and is not expiring."""
    if not (files.cert.exists() and files.key.exists()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    except ValueError:
        return False
    wanted = {str(_parse(n).value) for n in names}
    return (
        cert.issuer == ca.subject
        and cert.not_valid_after_utc - now > dt.timedelta(days=RENEW_BEFORE_DAYS)
        and _sans(cert) == wanted
        and _signed_by(cert, ca)
    )


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def ensure_certificates(directory: Path, names: Iterable[str]) -> TlsFiles:
    """The CA (made on first use, kept after) and a server certificate for ``names`` (DNS names and
    IP addresses) signed by it, made again when stale. Returns where they are."""
    files = TlsFiles(directory)
    wanted = list(dict.fromkeys(n for n in names if n))
    if not wanted:
        raise StackError("the stack's TLS certificate needs at least one name or address")
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)  # ca.pem must be readable; the keys are 0600 each
    now = dt.datetime.now(dt.UTC)
    if files.ca.exists() and files.ca_key.exists():
        ca, ca_key = _load_ca(files)
    else:
        ca, ca_key = _make_ca(files, now)
    if _current(files, ca, wanted, now):
        return files
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, wanted[0][:64])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=SERVER_DAYS), ca.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_parse(n) for n in wanted]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _key_text(files.key, key)
    _write_cert(files.cert, cert)
    return files


def san_names(cert_file: Path) -> list[str]:
    """The names and addresses a certificate is valid for."""
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    return sorted(_sans(cert))


def describe(files: TlsFiles) -> str:
    """One line for ``k3pipe stack status``: the CA to copy to nodes, the names the certificate
    carries, until when."""
    if not files.cert.exists():
        return f"no certificate yet in {files.directory} (`k3pipe stack up` makes one)"
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    until = cert.not_valid_after_utc.strftime("%Y-%m-%d")
    return (
        f"CA {files.ca} (copy it to each node); certificate for {', '.join(san_names(files.cert))}, "
        f"valid until {until}"
    )
