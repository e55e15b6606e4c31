"""TCP with TLS, against the real daemon: the token travels only inside TLS,
and client certificates name tenants. (Plain TCP off loopback is refused at
start: test_daemon_lifecycle's bad configurations.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import subprocess_env
from kvcache import make_kv_cache, namespace, prompt_keys
from test_daemon_lifecycle import free_port

from kvdepot import errors


@pytest.fixture
def pki(tmp_path):
    # Imported here, not at collection: the GPU machines run `-m cuda` without cryptography.
    from tls_certs import CA

    ca = CA(tmp_path)
    server_cert, server_key = ca.issue("kvdepotd", server=True)
    return ca, server_cert, server_key


def round_trip(client, prompt: int) -> None:
    """What a TCP client without a GPU can do: an engine's calls (CPU workers
    need the job socket, which a TCP daemon has none of)."""
    engine = client.register_engine(namespace("per_layer"))
    result = client.lookup(engine, prompt_keys(2, prompt=prompt))
    assert result.available and result.ready_blocks == 0


def test_a_token_over_tls_works_and_plain_or_untrusted_connections_do_not(start_daemon, tmp_path, pki):
    from kvdepot.client import KVDepotClient, OperatorClient, Tls

    ca, server_cert, server_key = pki
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    address = f"127.0.0.1:{free_port()}"
    start_daemon(listen=address, auth_token_file=str(token_file), tls_cert_file=str(server_cert),
                 tls_key_file=str(server_key))

    client = KVDepotClient(address, auth_token="s3cret", tls=Tls(ca_file=str(ca.path))).connect(10)
    try:
        round_trip(client, prompt=500)
        assert client.stats().namespaces[0].name.startswith("token/")
    finally:
        client.close()
    # Without TLS, or trusting another CA, nothing gets through (the token is never sent in clear).
    with pytest.raises(errors.Unavailable):
        OperatorClient(address, auth_token="s3cret", timeout=3).stats()
    other_ca = type(ca)(tmp_path, name="another CA")
    with pytest.raises(errors.Unavailable):
        OperatorClient(address, auth_token="s3cret", timeout=3, tls=Tls(ca_file=str(other_ca.path))).stats()
    with pytest.raises(errors.Unauthenticated):
        OperatorClient(address, auth_token="wrong", tls=Tls(ca_file=str(ca.path))).stats()


def test_client_certificates_name_tenants_without_a_token(start_daemon, tmp_path, pki):
    from kvdepot.client import KVDepotClient, OperatorClient, Tls

    ca, server_cert, server_key = pki
    engine_cert, engine_key = ca.issue("engine-a")
    stranger_cert, stranger_key = ca.issue("stranger")
    config = tmp_path / "kvdepot.toml"
    config.write_text('[[tenant]]\nname = "team-a"\ncert_names = ["engine-a"]\n')
    address = f"127.0.0.1:{free_port()}"
    start_daemon(listen=address, config=str(config), tls_cert_file=str(server_cert), tls_key_file=str(server_key),
                 tls_client_ca_file=str(ca.path))

    client = KVDepotClient(address, tls=Tls(str(ca.path), str(engine_cert), str(engine_key))).connect(10)
    try:
        engine = client.register_engine(namespace("per_layer"))
        assert client.lookup(engine, prompt_keys(2, prompt=510)).ready_blocks == 0
        [ns] = client.stats().namespaces
        assert ns.name.startswith("team-a/")
        # A CPU worker needs the job socket, which a TCP daemon has none of.
        tensors, block_dim = make_kv_cache("per_layer", seed=51)
        with pytest.raises(errors.FailedPrecondition, match="needs the daemon's job socket"):
            client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    finally:
        client.close()
    # A certificate the CA signed but no tenant names: known to TLS, not to the daemon.
    with pytest.raises(errors.Unauthenticated):
        OperatorClient(address, tls=Tls(str(ca.path), str(stranger_cert), str(stranger_key))).stats()
    # No certificate at all: the handshake fails.
    with pytest.raises(errors.Unavailable):
        OperatorClient(address, timeout=3, tls=Tls(str(ca.path))).stats()


def start_with_tls(tmp_path, cert, key, **extra) -> subprocess.CompletedProcess:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    args = [sys.executable, "-m", "kvdepot.server", "--listen", f"127.0.0.1:{free_port()}", "--pool-size", "4MiB",
            "--pin", "off", "--pool-dir", str(tmp_path), "--auth-token-file", str(token_file),
            "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    for name, value in extra.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return subprocess.run(args, capture_output=True, text=True, env=subprocess_env(), timeout=60)


def test_an_unusable_tls_file_is_named_with_what_is_wrong(tmp_path, pki):
    ca, server_cert, server_key = pki
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    text = tmp_path / "notes.txt"
    text.write_text("not PEM at all\n")
    _, other_key = ca.issue("another-server", server=True)
    cases = [
        (dict(cert=server_cert, key=garbage), [str(garbage), "--tls-key-file", "does not parse"]),
        (dict(cert=server_cert, key=other_key), [str(other_key), "not the key of the certificate", str(server_cert)]),
        (dict(cert=server_cert, key=text), [str(text), "--tls-key-file", "no PEM private key"]),
        (dict(cert=text, key=server_key), [str(text), "--tls-cert-file", "no PEM certificate"]),
        (dict(cert=garbage.with_name("absent.pem"), key=server_key), ["absent.pem", "--tls-cert-file", "No such file"]),
        (dict(cert=server_cert, key=server_key, tls_client_ca_file=text), [str(text), "--tls-client-ca-file"]),
    ]
    for files, wanted in cases:
        proc = start_with_tls(tmp_path, **files)
        assert proc.returncode == 2, proc.stderr
        for part in wanted:
            assert part in proc.stderr, (files, proc.stderr)
        assert "Failed to bind" not in proc.stderr and "Traceback" not in proc.stderr


def test_an_unusable_metrics_tls_key_is_named_too(tmp_path, pki):
    _, server_cert, _ = pki
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "s.sock"), "--pool-size", "4MiB",
         "--pin", "off", "--pool-dir", str(tmp_path), "--metrics-listen", f"127.0.0.1:{free_port()}",
         "--metrics-tls-cert-file", str(server_cert), "--metrics-tls-key-file", str(garbage)],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert str(garbage) in proc.stderr and "--metrics-tls-key-file" in proc.stderr and "does not parse" in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.glob("*.pool")) == []
