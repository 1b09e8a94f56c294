"""What a process shows and checks on every connection: the cluster token and TLS material.

One :class:`Credentials` object is built once per process, at its edges
(:meth:`Credentials.from_env`, a cluster resolver's ``credentials``, the
``--token-file``/``--tls-*`` flags of a task, ``LocalCluster``), and handed to
every server and client the process makes. Nothing reads a process-wide
default, so two tasks with different credentials can live in one process.

- **Token.** Every RPC except ``grpc.health.v1`` carries
  ``authorization: Bearer <token>``; a server with a token refuses calls
  without it (``UNAUTHENTICATED``); the data plane checks it in its hello.
  Health checks stay open because Kubernetes' native gRPC probes cannot send
  metadata, and they reveal nothing.
- **TLS** (optional, alongside the token): a :class:`TLSConfig` makes a
  server listen with TLS (mutual by default: clients must present a
  certificate signed by the CA) and a client connect with TLS, on gRPC and on
  the data plane alike. The token is still sent and checked.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import grpc

from jaxdist.base import errors as E

__all__ = [
    "AUTH_KEY",
    "Credentials",
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ENV_TLS_SERVER_NAME",
    "ENV_TOKEN",
    "PLAINTEXT",
    "TLSConfig",
]

#: Environment variable holding the cluster's shared auth token.
ENV_TOKEN = "JAXDIST_TOKEN"
ENV_TLS_CERT = "JAXDIST_TLS_CERT"
ENV_TLS_KEY = "JAXDIST_TLS_KEY"
ENV_TLS_CA = "JAXDIST_TLS_CA"
#: Optional: the name to check in servers' certificates instead of the host dialled.
ENV_TLS_SERVER_NAME = "JAXDIST_TLS_SERVER_NAME"

#: gRPC metadata key of the token.
AUTH_KEY = "authorization"


def _read_pem(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise E.ConfigurationError(f"cannot read TLS {what} {path!r}: {e}") from None


@dataclass(frozen=True)
class TLSConfig:
    """TLS material of one process (PEM file paths), used as server and as client.

    Attributes:
        cert: this process's certificate chain; needed to serve, and to
            connect to servers that require client certificates.
        key: the private key of ``cert``.
        ca: CA bundle that peers' certificates must chain to. A server with
            ``require_client_cert`` needs it; a client without it trusts the
            system roots.
        require_client_cert: a server rejects clients without a certificate
            signed by ``ca`` (mutual TLS). Default True.
        server_name: name checked in servers' certificates instead of the
            dialled host (for certificates that do not list every address).

    Files are read when a server starts or a channel is made, so a rotated
    certificate is used by the next connection.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    require_client_cert: bool = True
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise E.ConfigurationError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TLSConfig | None:
        """The config named by ``JAXDIST_TLS_*`` variables, or None when none is set."""
        env = os.environ if environ is None else environ
        cert, key, ca = env.get(ENV_TLS_CERT) or None, env.get(ENV_TLS_KEY) or None, env.get(ENV_TLS_CA) or None
        if not (cert or key or ca):
            return None
        return cls(cert=cert, key=key, ca=ca, server_name=env.get(ENV_TLS_SERVER_NAME) or None)

    def env(self) -> dict[str, str]:
        """Environment variables that make another process use this config."""
        out = {ENV_TLS_CERT: self.cert or "", ENV_TLS_KEY: self.key or "", ENV_TLS_CA: self.ca or ""}
        if self.server_name:
            out[ENV_TLS_SERVER_NAME] = self.server_name
        return {k: os.path.abspath(v) if v and k != ENV_TLS_SERVER_NAME else v for k, v in out.items()}

    def _check_server(self) -> None:
        if not self.cert:
            raise E.ConfigurationError("a TLS server needs a certificate and key (--tls-cert/--tls-key)")
        if self.require_client_cert and not self.ca:
            raise E.ConfigurationError("mutual TLS needs the CA that signs client certificates (--tls-ca)")

    def server_credentials(self) -> grpc.ServerCredentials:
        self._check_server()
        key, cert = _read_pem(self.key, "key"), _read_pem(self.cert, "certificate")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=_read_pem(self.ca, "CA"), require_client_auth=self.require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca, "CA"),
            private_key=_read_pem(self.key, "key"),
            certificate_chain=_read_pem(self.cert, "certificate"),
        )

    # The PS data plane (jaxdist.transport.dataplane) speaks TLS with the same files through Python's ssl.
    def server_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` server context with the same rules as :meth:`server_credentials`."""
        self._check_server()  # same checks and errors as server_credentials
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # No session tickets: a pooled idle connection must never have unsolicited bytes to read.
        ctx.num_tickets = 0
        try:
            ctx.load_cert_chain(self.cert, self.key)  # type: ignore[arg-type]
            if self.ca:
                ctx.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as e:
            raise E.ConfigurationError(f"cannot load TLS files for the data plane ({self.cert}, {self.ca}): {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else (ssl.CERT_OPTIONAL if self.ca else ssl.CERT_NONE)
        return ctx

    def client_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` client context with the same trust as :meth:`channel_credentials`
        (``ca``, else the system roots; this process's certificate when it has one)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server's certificate and name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.ca:
                ctx.load_verify_locations(cafile=self.ca)
            else:
                ctx.load_default_certs()
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise E.ConfigurationError(f"cannot load TLS files for the data plane ({self.cert}, {self.ca}): {e}") from None
        return ctx


@dataclass(frozen=True)
class Credentials:
    """The token and TLS material of one process (or one task in a process); immutable.

    Attributes:
        token: the cluster's shared token; None: send none and, as a server,
            check none (allowed on loopback only, or with ``insecure``).
        tls: TLS material; None: plaintext.

    ``Credentials()`` is plaintext without a token: a client with it is
    refused by any server that has a token, and a server with it refuses to
    bind a non-loopback address (see :class:`jaxdist.transport.server.Server`).
    """

    token: str | None = None
    tls: TLSConfig | None = None
    #: ``authorization`` metadata of every call (derived from ``token``).
    metadata: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.token is not None and not isinstance(self.token, str):
            raise E.ConfigurationError(f"the token must be a string, got {type(self.token).__name__}")
        object.__setattr__(self, "metadata", ((AUTH_KEY, f"Bearer {self.token}"),) if self.token else ())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Credentials:
        """The credentials named by ``JAXDIST_TOKEN`` and ``JAXDIST_TLS_*`` (plaintext, no token when unset)."""
        env = os.environ if environ is None else environ
        return cls(token=env.get(ENV_TOKEN) or None, tls=TLSConfig.from_env(env))

    def with_token(self, token: str | None) -> Credentials:
        """The same TLS material with another token."""
        return replace(self, token=token)

    def env(self) -> dict[str, str]:
        """Environment variables that give a child process these credentials (see :meth:`from_env`)."""
        out = {ENV_TOKEN: self.token or ""}
        if self.tls is not None:
            out.update(self.tls.env())
        return out

    def __repr__(self) -> str:  # never print the token
        return f"Credentials(token={'set' if self.token else None}, tls={self.tls!r})"


#: No token, no TLS: what tests on loopback use (a server with it refuses non-loopback binds).
PLAINTEXT = Credentials()


def tls_handshake(ctx: ssl.SSLContext, sock: socket.socket, *, server_side: bool = False,
                  server_hostname: str | None = None) -> ssl.SSLSocket:
    """Wrap ``sock`` (which it detaches) and complete the TLS handshake; on failure the wrapped
    socket is closed before the error propagates (``ctx.wrap_socket``'s own handshake would lose
    it: the plain socket is already detached, the new one never returned)."""
    secure = ctx.wrap_socket(sock, server_side=server_side, server_hostname=server_hostname,
                             do_handshake_on_connect=False)
    try:
        secure.do_handshake()
    except BaseException:
        secure.close()
        raise
    return secure
