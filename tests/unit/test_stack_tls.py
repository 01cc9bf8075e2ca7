"""The team stack's TLS (k3pipe.ops.tls, k3pipe.ops.stack): the CA made once and kept, the servers'
certificate for the names clients use, made again when they change; TLS on by default beyond loopback
and required there; the settings clients trust the CA by."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509

from k3pipe.core.errors import StackError
from k3pipe.core.settings import Settings
from k3pipe.ops.stack import StackConfig, _check_exposure, client_env, env_lines, security_lines
from k3pipe.ops.tls import ensure_certificates, san_names

pytestmark = pytest.mark.unit


def test_the_ca_is_kept_and_the_certificate_follows_the_names(tmp_path: Path) -> None:
    files = ensure_certificates(tmp_path / "tls", ["127.0.0.1", "localhost", "stack.lan"])
    assert san_names(files.cert) == ["127.0.0.1", "localhost", "stack.lan"]
    for key in (files.key, files.ca_key):
        assert key.stat().st_mode & 0o777 == 0o600
    assert files.ca.stat().st_mode & 0o777 == 0o644
    ca, cert = files.ca.read_bytes(), files.cert.read_bytes()
    # the same names: nothing made again
    ensure_certificates(tmp_path / "tls", ["127.0.0.1", "localhost", "stack.lan"])
    assert (files.ca.read_bytes(), files.cert.read_bytes()) == (ca, cert)
    # a new name: a new certificate from the same CA (the nodes keep trusting it)
    ensure_certificates(tmp_path / "tls", ["127.0.0.1", "localhost", "stack.lan", "10.1.2.3"])
    assert files.ca.read_bytes() == ca
    assert files.cert.read_bytes() != cert
    assert san_names(files.cert) == ["10.1.2.3", "127.0.0.1", "localhost", "stack.lan"]
    # Python's TLS stack accepts the chain (a CA with keyCertSign; serverAuth; the names as SANs)
    store = ssl.create_default_context(cafile=str(files.ca))
    assert store.get_ca_certs()[0]["subject"] == ((("commonName", "k3pipe stack CA"),),)
    leaf = x509.load_pem_x509_certificate(files.cert.read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(files.ca.read_bytes()))


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> StackConfig:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return StackConfig.from_settings(Settings(home=tmp_path), tmp_path)


def test_beyond_loopback_tls_is_on_by_default_and_may_not_be_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not _config(tmp_path, monkeypatch).tls
    exposed = _config(
        tmp_path, monkeypatch, K3PIPE_STACK_HOST="0.0.0.0", K3PIPE_STACK_TLS_NAMES="a.lan, 10.0.0.5"
    )
    assert exposed.tls
    assert exposed.auth
    assert exposed.url("mlflow").startswith("https://127.0.0.1:")
    assert {"a.lan", "10.0.0.5", "127.0.0.1", "localhost"} <= set(exposed.cert_names())
    _check_exposure(exposed)
    plain = _config(tmp_path, monkeypatch, K3PIPE_STACK_HOST="0.0.0.0", K3PIPE_STACK_TLS="false")
    with pytest.raises(StackError, match="K3PIPE_STACK_TLS off: the stack's password and every run"):
        _check_exposure(plain)


def test_clients_trust_the_stacks_ca_by_their_own_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, monkeypatch, K3PIPE_STACK_AUTH="true", K3PIPE_STACK_TLS="true")
    ca = str(config.tls_files.ca)
    env = client_env(config)
    assert env["PREFECT_API_SSL_CERT_FILE"] == env["MLFLOW_TRACKING_SERVER_CERT_PATH"] == ca
    assert env["PREFECT_API_URL"].startswith("https://")
    password = config.credentials()[1]  # type: ignore[index]
    assert env["MLFLOW_TRACKING_PASSWORD"] == password
    lines = env_lines(config)
    assert f"export PREFECT_API_SSL_CERT_FILE={ca}" in lines
    assert f"export MLFLOW_TRACKING_SERVER_CERT_PATH={ca}" in lines
    assert password not in "\n".join(lines + security_lines(config))
    assert "tls: on (no certificate yet" in "\n".join(security_lines(config))
