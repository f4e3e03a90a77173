"""``dadfl.server.certs`` — a development CA and a server certificate signed by it (``dadfl certs``); site certificates.

For tests, demos and docker-compose: a real deployment uses certificates from the
hospital's own PKI. The server certificate names ``localhost``, ``127.0.0.1`` and every
extra host given (e.g. the compose service name ``coordinator``).

Mutual TLS: ``dadfl enroll SITE --cert`` issues the site a certificate signed by the
federation CA whose common name and DNS subject alternative name are the site id. With
``listen.require_client_cert`` the coordinator's TLS layer refuses a connection without a
certificate from ``listen.client_ca``, and :func:`check_client_certificate` binds the
certificate to the site id of the hello (and to the enrolment: not revoked, the serial
that was issued).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .enrol import Enrolled, EnrolmentError, verify_certificate

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


def issue_site_certificate(ca_dir: Path, site_id: str, out_dir: Path) -> tuple[Path, Path, int]:
    """Write ``<site_id>.pem`` and ``<site_id>.key`` into ``out_dir``, signed by the CA in
    ``ca_dir`` (``ca.pem``, ``ca.key``); return their paths and the certificate's serial."""
    ca_pem, ca_key_path = ca_dir / "ca.pem", ca_dir / "ca.key"
    for path in (ca_pem, ca_key_path):
        if not path.is_file():
            raise ValueError(f"{path} does not exist: --ca-dir must hold the federation CA's ca.pem and ca.key (`dadfl certs` makes a development CA)")
    ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    serial = x509.random_serial_number()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(site_id))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(site_id)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{site_id}.pem", out_dir / f"{site_id}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_key_bytes(key))
    os.chmod(key_path, 0o600)
    return cert_path, key_path, serial


def certificate_names(cert: x509.Certificate) -> set[str]:
    """The common names and DNS subject alternative names of a certificate."""
    names = {attribute.value for attribute in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
    try:
        names.update(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        pass
    return names


def check_client_certificate(context, enrolled: Enrolled, site_id: str, required: bool) -> None:
    """Raise :class:`EnrolmentError` (UNAUTHENTICATED) unless the stream's client certificate,
    when there is one or ``required``, names ``site_id`` and is not revoked in ``enrolled``."""
    pem = context.auth_context().get("x509_pem_cert")
    if not pem:
        if required:
            raise EnrolmentError(
                f"site {site_id!r} presented no client certificate and this server requires one "
                f"(listen.require_client_cert): set connect.client_cert and connect.client_key from `dadfl enroll {site_id} --cert`",
                unknown=True,
            )
        return
    cert = x509.load_pem_x509_certificate(pem[0])
    names = certificate_names(cert)
    if site_id not in names:
        shown = ", ".join(sorted(repr(name[:64]) for name in names)[:4]) or "no names"
        raise EnrolmentError(f"the client certificate names {shown}, not site {site_id!r}: a site must use its own certificate", unknown=True)
    try:
        verify_certificate(enrolled, site_id, cert.serial_number)
    except EnrolmentError as exc:
        raise EnrolmentError(str(exc), unknown=True) from None


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
