"""Mutual TLS: a TLS-only PS accepts only clients with a certificate from its CA; the token is still checked;
``jaxdist certs``; ``--tls-*`` flags; a LocalCluster with ``tls_dir`` trains."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="the `tls` extra (cryptography) generates the test certificates")

from conftest import TOKEN  # noqa: E402

from jaxdist.tools import certs  # noqa: E402
from jaxdist.errors import AuthenticationError, PSUnavailableError  # noqa: E402
from jaxdist.transport.credentials import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, Credentials, TLSConfig  # noqa: E402
from jaxdist.ps_server.client import CreateSpec, PSClient, PullSpec  # noqa: E402
from jaxdist.ps_server.server import ParameterServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[certs.CertPaths, certs.CertPaths]:
    """The cluster's certificates, and another CA's (an impostor)."""
    base = tmp_path_factory.mktemp("pki")
    return certs.generate(str(base / "cluster")), certs.generate(str(base / "other"))


@pytest.fixture
def tls_ps(pki: tuple[certs.CertPaths, certs.CertPaths]) -> Iterator[ParameterServer]:
    ps = ParameterServer(credentials=Credentials(TOKEN, pki[0].server_tls()))
    ps.start()
    yield ps
    ps.stop(grace=None)


def _client(address: str, tls: TLSConfig | None, token: str = TOKEN, shared_memory: bool = True) -> PSClient:
    return PSClient(address, Credentials(token, tls), task="ps:0", shared_memory=shared_memory)


def test_certs_are_what_the_cli_says(pki: tuple[certs.CertPaths, certs.CertPaths]) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    p = pki[0]
    server = x509.load_pem_x509_certificate(Path(p.server_cert).read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    usages = set(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    client = x509.load_pem_x509_certificate(Path(p.client_cert).read_bytes())
    assert set(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    for key in (p.ca_key, p.server_key, p.client_key):
        assert os.stat(key).st_mode & 0o077 == 0, f"{key} is readable by others"


def test_valid_client_certificate_is_accepted(tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths]) -> None:
    for tls in (pki[0].client_tls(), pki[0].server_tls()):  # tools' client cert, and a task's cert
        with _client(tls_ps.address, tls) as c:
            c.create([CreateSpec("v", value=np.ones(3, np.float32), if_exists="keep")])
            (value, _version), = c.pull([PullSpec("v")])
            assert value is not None and value.tolist() == [1.0, 1.0, 1.0]
            # Tensors went over the data plane, which speaks TLS too.
            assert tls_ps.data_port and c.uses_data_plane is True


BAD_CLIENTS = ["plaintext", "tls_without_client_cert", "cert_from_another_ca", "server_not_trusted"]


def _bad_tls(pki: tuple[certs.CertPaths, certs.CertPaths], kind: str) -> TLSConfig | None:
    """The TLS config of a client the cluster must refuse (or that must refuse the cluster)."""
    ours, other = pki
    return {
        "plaintext": None,
        "tls_without_client_cert": TLSConfig(ca=ours.ca),
        # An impostor trusting our CA (so it would accept the server) but with its own CA's certificate.
        "cert_from_another_ca": TLSConfig(cert=other.client_cert, key=other.client_key, ca=ours.ca),
        # A valid client that trusts another CA, so it refuses our server.
        "server_not_trusted": TLSConfig(cert=ours.client_cert, key=ours.client_key, ca=other.ca),
    }[kind]


@pytest.mark.parametrize("kind", BAD_CLIENTS)
def test_clients_without_a_valid_certificate_are_rejected(
    tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths], kind: str
) -> None:
    tls = _bad_tls(pki, kind)
    with _client(tls_ps.address, tls) as c, pytest.raises(PSUnavailableError):
        c.status(timeout=5)
    assert tls_ps.servicer.counters.snapshot()["pulls"] == 0 and tls_ps.servicer.counters.snapshot()["pushes"] == 0


def test_client_refuses_a_server_from_another_ca(pki: tuple[certs.CertPaths, certs.CertPaths]) -> None:
    ours, other = pki
    with ParameterServer(credentials=Credentials(TOKEN, other.server_tls())) as impostor, _client(impostor.address, ours.client_tls()) as c:
        with pytest.raises(PSUnavailableError):
            c.status(timeout=5)


def test_token_is_still_required_over_tls(tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths]) -> None:
    with _client(tls_ps.address, pki[0].client_tls(), token="wrong-token") as c, pytest.raises(AuthenticationError):
        c.status(timeout=5)


def test_credentials_come_from_the_environment_only_where_asked(
    tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths], monkeypatch: pytest.MonkeyPatch
) -> None:
    import jaxdist

    p = pki[0]
    monkeypatch.setenv(ENV_TLS_CERT, p.client_cert)
    monkeypatch.setenv(ENV_TLS_KEY, p.client_key)
    monkeypatch.setenv(ENV_TLS_CA, p.ca)
    monkeypatch.setenv("JAXDIST_TOKEN", TOKEN)
    from_env = Credentials.from_env()
    assert from_env.token == TOKEN and from_env.tls == TLSConfig(cert=p.client_cert, key=p.client_key, ca=p.ca)
    with PSClient(tls_ps.address, from_env) as c:  # the environment says TLS and token
        assert c.status(timeout=5).role == "ps"
    resolver = jaxdist.SimpleClusterResolver({"ps": [tls_ps.address], "worker": ["127.0.0.1:1"]})
    assert resolver.credentials == from_env  # a resolver reads the environment by default...
    plain = jaxdist.SimpleClusterResolver({"ps": [tls_ps.address]}, tls=None)
    assert plain.credentials.tls is None  # ...unless told otherwise
    with PSClient(tls_ps.address, Credentials(TOKEN)) as c, pytest.raises(PSUnavailableError):
        c.status(timeout=5)  # nothing process-wide: a client without TLS material speaks plaintext
    assert "test-token" not in repr(from_env)  # credentials never print the token


def test_certificate_without_key_is_a_configuration_error() -> None:
    from jaxdist.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="both a certificate and its key"):
        TLSConfig(cert="/x.crt")


def test_certs_command_and_tls_flags_of_a_ps_process(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    r = subprocess.run([sys.executable, "-m", "jaxdist.tools.cli", "certs", "--out", str(out), "--hosts", "127.0.0.1,localhost"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    p = certs.paths(str(out))
    env = {**os.environ, "JAXDIST_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu"}
    for k in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA):
        env.pop(k, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.ps_server", "--port", "0", "--tls-cert", p.server_cert, "--tls-key", p.server_key,
         "--tls-ca", p.ca], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("JAXDIST_READY role=ps index=0 port="), f"no ready line: {line!r}"
        address = f"127.0.0.1:{line.split('port=')[1].split()[0]}"
        with _client(address, p.client_tls()) as c:
            assert c.status(timeout=10).role == "ps"
        with _client(address, None) as c, pytest.raises(PSUnavailableError):
            c.status(timeout=5)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # waits and closes both pipes
        assert proc.returncode == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_local_cluster_with_tls_trains(tmp_path: Path) -> None:
    import jaxdist

    with jaxdist.LocalCluster(num_workers=2, num_ps=1, tls_dir=str(tmp_path / "tls")) as cluster:
        assert certs.exists(str(tmp_path / "tls"))
        env = cluster.coordinator_env()
        assert env[ENV_TLS_CA].endswith("ca.crt")
        assert cluster.credentials.tls is not None and cluster.cluster_resolver().credentials == cluster.credentials
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.float32), name="counter")
        coord = jaxdist.ClusterCoordinator(strategy)

        def step() -> int:
            counter.assign_add(np.float32(1.0))
            return jaxdist.current_worker_index()

        rvs = [coord.schedule(step) for _ in range(40)]
        coord.join()
        assert sorted({rv.fetch() for rv in rvs}) in ([0], [1], [0, 1])
        assert float(counter.numpy()) == 40.0
        # The tasks really serve TLS only: a plaintext caller gets nowhere.
        with _client(cluster.address("ps:0"), None, token=cluster.token) as c, pytest.raises(PSUnavailableError):
            c.status(timeout=5)
        coord.shutdown()
        assert cluster.wait_exit(30) == {"ps:0": 0, "worker:0": 0, "worker:1": 0}


# ------------------------------------------------------------ data plane over TLS
@pytest.mark.parametrize("shm", [True, False], ids=["shared_memory", "socket"])
def test_data_plane_over_tls_moves_tensors_exactly(
    tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths], shm: bool
) -> None:
    from jaxdist.transport import dataplane
    from jaxdist.proto.ps_wire import Op, Update

    big = np.random.default_rng(0).standard_normal((1000, 700)).astype(np.float32)  # 2.8 MB: several records/slots
    with _client(tls_ps.address, pki[0].client_tls(), shared_memory=shm) as c:
        c.create([CreateSpec("big", value=big)])
        c.push([Update("big", Op.ASSIGN_ADD, big)])
        ((got, version),) = c.pull([PullSpec("big")])
        assert version == 2 and np.array_equal(got, 2 * big)
        assert c.uses_data_plane is True and c.uses_shared_memory == (shm and dataplane.shm_enabled())
    assert tls_ps.servicer.counters.snapshot()["pulls"] >= 1


def _data_plane_client(ps: ParameterServer, tls: TLSConfig | None, token: str = TOKEN) -> object:
    from jaxdist.transport import dataplane

    return dataplane.DataPlaneClient("127.0.0.1", ps.data_port, Credentials(token, tls))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", BAD_CLIENTS)
def test_data_port_rejects_clients_without_a_valid_certificate(
    tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths], kind: str
) -> None:
    import grpc

    from jaxdist.transport import dataplane

    ours = pki[0]
    c = _data_plane_client(tls_ps, _bad_tls(pki, kind))
    try:
        with pytest.raises(dataplane.DataPlaneError) as e:
            c.call(dataplane.PULL, b"", (), timeout=5)  # type: ignore[attr-defined]
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and not e.value.connected
    finally:
        c.close()  # type: ignore[attr-defined]
    # The server is unharmed: a valid client still gets served.
    with _client(tls_ps.address, ours.client_tls()) as good:
        good.create([CreateSpec("v", value=np.ones(3, np.float32), if_exists="keep")])
        assert good.pull([PullSpec("v")])[0][0].tolist() == [1.0, 1.0, 1.0] and good.uses_data_plane is True
    assert tls_ps.servicer.counters.snapshot()["pulls"] == 1


def test_data_plane_over_tls_still_checks_the_token(tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths]) -> None:
    import grpc

    from jaxdist.transport import dataplane

    c = _data_plane_client(tls_ps, pki[0].client_tls(), token="wrong-token")
    try:
        with pytest.raises(dataplane.DataPlaneError) as e:
            c.call(dataplane.PULL, b"", (), timeout=5)  # type: ignore[attr-defined]
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        c.close()  # type: ignore[attr-defined]


def test_garbage_on_the_tls_data_port_ends_only_that_connection(tls_ps: ParameterServer, pki: tuple[certs.CertPaths, certs.CertPaths]) -> None:
    import socket

    for junk in (b"JXB1\x00\x00\x00\x00", b"\x16\x03\x01\xff\xff" + b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", tls_ps.data_port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(15)
            try:
                while s.recv(4096):  # a TLS alert at most, then the server closes
                    pass
            except ConnectionResetError:
                pass
    with _client(tls_ps.address, pki[0].client_tls()) as good:
        good.create([CreateSpec("w", value=np.zeros(2, np.float32))])
        assert good.pull([PullSpec("w")])[0][1] == 1 and good.uses_data_plane is True
