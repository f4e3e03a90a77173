"""A development CA and a server certificate signed by it (``dadfl certs``).

For tests, demos and docker-compose: a real deployment uses certificates from the
hospital's own PKI. The server certificate names ``localhost``, ``127.0.0.1`` and every
extra host given (e.g. the compose service name ``coordinator``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dadfl development"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_dev_certs(out_dir: Path, hosts: tuple[str, ...] = ()) -> dict[str, Path]:
    """Write ``ca.pem``, ``ca.key``, ``server.pem``, ``server.key`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("dadfl development CA"))
        .issuer_name(_name("dadfl development CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = list(dict.fromkeys(("localhost", "127.0.0.1", *hosts)))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[-1]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(host) for host in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "ca.pem": ca_cert.public_bytes(serialization.Encoding.PEM),
        "ca.key": _key_bytes(ca_key),
        "server.pem": server_cert.public_bytes(serialization.Encoding.PEM),
        "server.key": _key_bytes(server_key),
    }
    written = {}
    for name, data in paths.items():
        path = out_dir / name
        path.write_bytes(data)
        if name.endswith(".key"):
            os.chmod(path, 0o600)
        written[name] = path
    return written


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
