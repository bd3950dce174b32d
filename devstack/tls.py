"""TLS material of the local stack: a certificate authority and server certificates, made with `openssl`.

Nothing here is committed or reused between machines: the files are made at stack start (or by a
test) into a directory of the stack's home, `<home>/tls/` by default::

    <home>/tls/ca.crt, ca.key         the stack's own CA (clients trust ca.crt: libpq's `sslrootcert`,
                                      `TAPELINE_S3_CA_BUNDLE`)
    <home>/tls/<name>.crt, <name>.key a server certificate signed by it, its subject alternative names
                                      the host names and IP addresses its clients connect to

`libpq` with `sslmode=verify-full` and botocore (urllib3) check the server's name against the
subject alternative names only (RFC 6125; the common name is ignored when SANs are present), so
every name a client uses (`127.0.0.1`, `localhost`) must be listed.

The pieces `tapeline stack up` can use to serve PostgreSQL and S3 over TLS:
`stack_ca`/`server_certificate` make the files, `devstack.pgserver.tls_server_options` turns a
PostgreSQL server's TLS on with them at start (`up_own_postgres(tls=...)`), `turn_tls_on` in a running
server by a reload (the Debian cluster the stack shares), `require_client_certificate` makes a role
log in by a `client_certificate` only; `devstack.s3server --certfile/--keyfile` (`devstack.s3.up_s3(tls=...)`)
serves S3 over HTTPS.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tapeline.home import StackError

CA_DAYS = 30
"""Validity of the stack's CA and of the certificates it signs, days: made at stack start, so short."""
KEY_BITS = 2048
"""RSA key size, bits (NIST SP 800-57 part 1: 2048-bit RSA is acceptable through 2030)."""


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA of the local stack: `cert` (PEM, what clients trust) and `key` (PEM, private)."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ServerCertificate:
    """A server's PEM certificate `cert` (signed by the stack's CA), its private key `key`, and the
    CA's certificate `ca` (None: unknown), which a server given it verifies client certificates with."""

    cert: Path
    key: Path
    ca: Path | None = None


@dataclass(frozen=True)
class ClientCertificate:
    """A client's PEM certificate `cert` (signed by the stack's CA; its common name is the user it
    logs in as) and its private key `key`: libpq's `sslcert` and `sslkey`."""

    cert: Path
    key: Path


def openssl(*args: str) -> None:
    """Run `openssl args...`. Raises `StackError` with openssl's output when it fails or is missing."""
    if shutil.which("openssl") is None:
        raise StackError("openssl is not installed; `apt-get install -y openssl` (the stack's TLS certificates "
                         "are made with it)")
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise StackError(f"openssl {args[0]} failed: {(done.stdout + done.stderr).strip()[-1500:]}")


def stack_ca(directory: Path, name: str = "Tapeline local stack CA") -> CertificateAuthority:
    """The CA in `directory` (`ca.crt`, `ca.key`): reused when both files exist, else made now
    (RSA `KEY_BITS`, self-signed, `CA_DAYS` days, basicConstraints CA:TRUE). The key is mode 0600.

    Raises:
        StackError: openssl is missing or fails.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority(directory / "ca.crt", directory / "ca.key")
    if ca.cert.is_file() and ca.key.is_file():
        return ca
    openssl("req", "-x509", "-newkey", f"rsa:{KEY_BITS}", "-nodes", "-days", str(CA_DAYS), "-subj", f"/CN={name}",
             "-keyout", str(ca.key), "-out", str(ca.cert),
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    ca.key.chmod(0o600)
    return ca


def subject_alt_names(hosts: list[str]) -> str:
    """The `subjectAltName` value for `hosts`: `IP:` for an IP address, `DNS:` for a name, in order,
    e.g. `["127.0.0.1", "localhost"]` -> `"IP:127.0.0.1,DNS:localhost"`. Raises `ValueError` for an
    empty list. Pure."""
    if not hosts:
        raise ValueError("a server certificate needs at least one host name or address")
    names = []
    for host in hosts:
        try:
            names.append(f"IP:{ipaddress.ip_address(host.strip('[]'))}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def _signed(ca: CertificateAuthority, directory: Path, name: str, common_name: str,
            extensions: list[str]) -> tuple[Path, Path]:
    """`<directory>/<name>.crt` and `.key` (mode 0600): a new RSA key and its certificate for
    `common_name`, signed by `ca` for `CA_DAYS` days with `extensions` (openssl extfile lines)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    request, extfile = directory / f"{name}.csr", directory / f"{name}.ext"
    openssl("req", "-new", "-newkey", f"rsa:{KEY_BITS}", "-nodes", "-subj", f"/CN={common_name}",
             "-keyout", str(key), "-out", str(request))
    key.chmod(0o600)
    extfile.write_text("\n".join(["basicConstraints=CA:FALSE", *extensions]) + "\n")
    openssl("x509", "-req", "-in", str(request), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-days", str(CA_DAYS), "-sha256", "-extfile", str(extfile), "-out", str(cert))
    request.unlink(missing_ok=True)
    extfile.unlink(missing_ok=True)
    return cert, key


def server_certificate(ca: CertificateAuthority, directory: Path, name: str, hosts: list[str],
                       common_name: str | None = None, client_auth: bool = False) -> ServerCertificate:
    """A new certificate `<directory>/<name>.crt` with key `<name>.key` (mode 0600), signed by `ca`,
    valid for `hosts` (`subject_alt_names`; the common name is `common_name`, else the first host) for
    `CA_DAYS` days, extendedKeyUsage serverAuth (and clientAuth with `client_auth`: a Kafka broker
    presents it to its controller too). Made again on every call (the names may have changed).

    Raises:
        StackError: openssl is missing or fails.
        ValueError: `hosts` is empty.
    """
    usage = "serverAuth,clientAuth" if client_auth else "serverAuth"
    cert, key = _signed(ca, directory, name, common_name or (hosts[0] if hosts else name),
                        [f"subjectAltName={subject_alt_names(hosts)}",
                         "keyUsage=critical,digitalSignature,keyEncipherment", f"extendedKeyUsage={usage}"])
    return ServerCertificate(cert, key, ca.cert)


def client_certificate(ca: CertificateAuthority, directory: Path, name: str, user: str) -> ClientCertificate:
    """A new client certificate `<directory>/<name>.crt` with key `<name>.key` (mode 0600), signed by
    `ca`, common name `user` (PostgreSQL's `cert` authentication logs the client in as the user its
    certificate names), extendedKeyUsage clientAuth, `CA_DAYS` days.

    Raises:
        StackError: openssl is missing or fails.
    """
    cert, key = _signed(ca, directory, name, user,
                        ["keyUsage=critical,digitalSignature,keyEncipherment", "extendedKeyUsage=clientAuth"])
    return ClientCertificate(cert, key)
