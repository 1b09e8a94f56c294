"""``jaxdist certs``: a self-signed CA and the certificates a TLS cluster needs.

Writes into ``--out``:

- ``ca.crt`` / ``ca.key``: the cluster's CA (keep ``ca.key`` off the tasks);
- ``server.crt`` / ``server.key``: the certificate every task (PS, worker)
  and the coordinator uses: valid for TLS servers *and* clients (workers
  call the PS), with every ``--hosts`` entry as a subject alternative name
  (IP addresses as IP SANs, names as DNS SANs; ``*.svc.cluster.local``-style
  wildcards work);
- ``client.crt`` / ``client.key``: a client-only certificate for tools
  (``jaxdist status``) and scripts that only call tasks.

Keys are ECDSA P-256, written mode 0600. Needs the ``cryptography`` package
(``pip install 'jaxdist[tls]'``); the tasks themselves do not.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from jaxdist.transport.credentials import TLSConfig

logger = logging.getLogger(__name__)

__all__ = ["CertPaths", "generate", "main"]


@dataclass(frozen=True)
class CertPaths:
    """Where :func:`generate` wrote each file (absolute paths)."""

    ca: str
    ca_key: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_tls(self) -> TLSConfig:
        """A :class:`~jaxdist.transport.credentials.TLSConfig` for tasks (server + client use)."""
        return TLSConfig(cert=self.server_cert, key=self.server_key, ca=self.ca)

    def client_tls(self) -> TLSConfig:
        """A :class:`~jaxdist.transport.credentials.TLSConfig` for callers only (tools, scripts)."""
        return TLSConfig(cert=self.client_cert, key=self.client_key, ca=self.ca)


def paths(out_dir: str) -> CertPaths:
    """The file names :func:`generate` uses in ``out_dir`` (whether or not they exist)."""
    d = os.path.abspath(out_dir)
    return CertPaths(*(os.path.join(d, n) for n in ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key")))


def exists(out_dir: str) -> bool:
    """True when every file of :func:`paths` is present."""
    return all(os.path.exists(p) for p in vars(paths(out_dir)).values())


def _san(hosts: Sequence[str]) -> list[object]:
    from cryptography import x509

    out: list[object] = []
    for h in hosts:
        h = h.strip().strip("[]")
        if not h:
            continue
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def generate(out_dir: str, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 365,
             common_name: str = "jaxdist") -> CertPaths:
    """Create a CA and the server and client certificates in ``out_dir`` (created if needed).

    Args:
        out_dir: directory for the files (existing files are replaced).
        hosts: addresses and DNS names the tasks are dialled at; the server
            certificate is valid for exactly these.
        days: validity of every certificate.
        common_name: prefix of the subjects' common names.

    Returns:
        The paths written.

    Raises:
        ImportError: ``cryptography`` is not installed (``pip install 'jaxdist[tls]'``).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(out_dir, exist_ok=True)
    p = paths(out_dir)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    until = now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "jaxdist"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: str) -> None:
        data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)

    def write_cert(cert: x509.Certificate, path: str) -> None:
        with open(path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"{common_name} CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usages: list[x509.ObjectIdentifier], sans: list[object]) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn)).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)  # type: ignore[arg-type]
        return b.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf(f"{common_name} task", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], _san(hosts))
    client, client_key = leaf(f"{common_name} client", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    write_key(ca_key, p.ca_key)
    write_cert(ca, p.ca)
    write_key(server_key, p.server_key)
    write_cert(server, p.server_cert)
    write_key(client_key, p.client_key)
    write_cert(client, p.client_cert)
    logger.info("wrote CA, server and client certificates for %s to %s", ",".join(hosts), out_dir)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxdist certs",
        description="Generate a self-signed CA and the server and client certificates of a TLS cluster.",
    )
    ap.add_argument("--out", required=True, help="directory to write ca.crt, server.crt/.key, client.crt/.key into")
    ap.add_argument("--hosts", default="127.0.0.1,localhost",
                    help="comma-separated addresses and DNS names tasks are reached at (default %(default)s)")
    ap.add_argument("--days", type=int, default=365, help="validity in days (default %(default)s)")
    args = ap.parse_args(argv)
    try:
        p = generate(args.out, [h for h in args.hosts.split(",") if h.strip()], days=args.days)
    except ImportError:
        print("jaxdist certs: needs the 'cryptography' package: pip install 'jaxdist[tls]'", file=sys.stderr)
        return 2
    print(f"wrote {p.ca}, {p.server_cert}, {p.client_cert} (and keys, mode 0600)")
    print(f"tasks:       jaxdist ps|worker --tls-cert {p.server_cert} --tls-key {p.server_key} --tls-ca {p.ca} ...")
    print(f"coordinator: export JAXDIST_TLS_CERT={p.server_cert} JAXDIST_TLS_KEY={p.server_key} JAXDIST_TLS_CA={p.ca}")
    print(f"tools:       export JAXDIST_TLS_CERT={p.client_cert} JAXDIST_TLS_KEY={p.client_key} JAXDIST_TLS_CA={p.ca}")
    return 0
