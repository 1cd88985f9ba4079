"""Key and certificate files of the two planes' encryption (docs/security.md), and ``bitps-keygen``.

CURVE key files are ZeroMQ's certificates, as ``zmq.auth.create_certificates`` writes them: a
``NAME.key`` file holds a ``public-key``, a ``NAME.key_secret`` file the same ``public-key`` and
its ``secret-key``, each 40 characters of Z85 (32 bytes)::

    metadata
    curve
        public-key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
        secret-key = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"

:func:`load_public_key`, :func:`load_key_pair` and :func:`load_allowed_keys` read them for the
shards and the workers alike, and refuse a file that is missing, has no key, a key that is not
40 characters of Z85, or a secret where a public key is expected (a secret handed out as a
public key has leaked) with a :class:`KeyFileError` naming the file and what was expected.
:func:`read_pem` does the same for gRPC's TLS certificates and keys.

``bitps-keygen DIR [--name NAME]`` writes a shard key pair (``server.key``,
``server.key_secret``; kept when already there) and a client pair (``NAME.key``,
``NAME.key_secret``), and copies the client's public key into ``DIR/allowed/``, the directory a
shard's ``curve_allowed_keys`` names. Secret files are created with mode 0600.

No torch here (``bitps.proto`` is shared by shards and workers); zmq only for its Z85 and key
functions.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import zmq

__all__ = ["ALLOWED_DIR", "KeyFileError", "SERVER_NAME", "keygen", "load_allowed_keys",
           "load_key_pair", "load_public_key", "main", "read_pem"]

SERVER_NAME = "server"
"""File stem of the shard key pair ``bitps-keygen`` writes."""
ALLOWED_DIR = "allowed"
"""Sub-directory of ``bitps-keygen``'s DIR that holds the allowed clients' public keys."""
_Z85 = re.compile(rb"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_LINE = re.compile(rb"^\s*(public-key|secret-key)\s*=\s*(.*?)\s*$")


class KeyFileError(ValueError):
    """A key or certificate file was refused: ``path`` is the file, ``expected`` what it
    should have held, and the message says what it held instead."""

    def __init__(self, path: str | os.PathLike, problem: str, expected: str) -> None:
        self.path, self.problem, self.expected = str(path), problem, expected
        super().__init__(f"{path}: {problem}; expected {expected}")


def _read_keys(path: str | os.PathLike, expected: str) -> dict[str, bytes]:
    """The ``public-key`` / ``secret-key`` entries of a ZeroMQ certificate file, each checked
    to be 40 characters of Z85."""
    try:
        text = Path(path).read_bytes()
    except OSError as err:
        raise KeyFileError(path, f"cannot be read ({err.strerror or err})", expected) from None
    found: dict[str, bytes] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.lstrip().startswith(b"#"):
            continue
        name, value = m.group(1).decode(), m.group(2).strip(b"'\"")
        if not _Z85.match(value):
            raise KeyFileError(path, f"its {name} is {len(value)} characters, not 40 of Z85",
                               expected)
        found[name] = value
    if "public-key" not in found:
        raise KeyFileError(path, "holds no public-key line", expected)
    return found


def load_public_key(path: str | os.PathLike) -> bytes:
    """The Z85 public key (40 bytes) of a ``.key`` file; a file that holds a secret key too is
    refused: a public key is what one hands out, and this one came with its secret."""
    expected = "a CURVE public key file (NAME.key: public-key = 40 Z85 characters, no secret)"
    found = _read_keys(path, expected)
    if "secret-key" in found:
        raise KeyFileError(path, "holds a secret-key (a .key_secret file)", expected)
    return found["public-key"]


def load_key_pair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)``, Z85, of a ``.key_secret`` file; the secret must be the public
    key's."""
    expected = "a CURVE secret key file (NAME.key_secret: public-key and secret-key)"
    found = _read_keys(path, expected)
    if "secret-key" not in found:
        raise KeyFileError(path, "holds only a public-key (a .key file)", expected)
    public, secret = found["public-key"], found["secret-key"]
    if zmq.curve_public(secret) != public:
        raise KeyFileError(path, "its secret-key does not belong to its public-key", expected)
    return public, secret


def load_allowed_keys(directory: str | os.PathLike) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in ``directory``: the clients a shard lets in.
    A directory that is missing, holds no ``.key`` file, or holds a secret is refused (nobody
    could connect; a client's secret has no business on a shard)."""
    expected = "a directory of CURVE public key files (*.key, no *.key_secret)"
    d = Path(directory)
    if not d.is_dir():
        raise KeyFileError(d, "is not a directory", expected)
    secrets_ = sorted(d.glob("*.key_secret"))
    if secrets_:
        raise KeyFileError(secrets_[0], "is a secret key file in the allowed-keys directory",
                           expected)
    keys = frozenset(load_public_key(p) for p in sorted(d.glob("*.key")))
    if not keys:
        raise KeyFileError(d, "holds no *.key file", expected)
    return keys


def read_pem(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a PEM file (a TLS certificate, key or CA bundle), refused unless it holds
    a ``-----BEGIN`` block; ``what`` names it in the error (``"a certificate"``)."""
    expected = f"{what} in PEM (-----BEGIN ...-----)"
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise KeyFileError(path, f"cannot be read ({err.strerror or err})", expected) from None
    if b"-----BEGIN " not in data:
        raise KeyFileError(path, f"is {len(data)} bytes without a PEM block", expected)
    return data


# -- bitps-keygen ----------------------------------------------------------------------------------
def _write(path: Path, public: bytes, secret: bytes | None) -> None:
    kind = "Secret" if secret else "Public"
    body = (f"#   ****  Generated on {time.strftime('%Y-%m-%d %H:%M:%S')} by bitps-keygen  "
            f"****\n#   ZeroMQ CURVE {kind} Certificate\n"
            + ("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n"
               if secret else "#   Exchange securely, or use a secure mechanism to verify "
                              "the contents\n#   of this file after exchange.\n")
            + f"\nmetadata\ncurve\n    public-key = \"{public.decode()}\"\n")
    if secret:
        body += f"    secret-key = \"{secret.decode()}\"\n"
    # O_EXCL: never overwrite a key; mode 0600 from the first byte for a secret (no chmod race)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(body)


def keygen(directory: str | os.PathLike, name: str = "client") -> dict[str, Path]:
    """Write a client key pair ``NAME.key`` / ``NAME.key_secret`` and ``allowed/NAME.key``
    into ``directory`` (made if missing), and the shard pair ``server.key`` /
    ``server.key_secret`` unless it is there already (so one call per worker adds clients to
    one shard key). Returns the paths by role. Refuses (``FileExistsError``) to overwrite a
    client pair, and a name that is not a plain file stem (``ValueError``)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name == SERVER_NAME:
        raise ValueError(f"name {name!r}: expected a file stem of letters, digits, '_', '.', "
                         f"'-' (not {SERVER_NAME!r})")
    d = Path(directory)
    (d / ALLOWED_DIR).mkdir(parents=True, exist_ok=True)
    out = {"server_key": d / f"{SERVER_NAME}.key",
           "server_secret": d / f"{SERVER_NAME}.key_secret",
           "client_key": d / f"{name}.key", "client_secret": d / f"{name}.key_secret",
           "allowed": d / ALLOWED_DIR / f"{name}.key"}
    for role in ("client_key", "client_secret", "allowed"):
        if out[role].exists():
            raise FileExistsError(f"{out[role]} exists; expected a new client name "
                                  f"(--name), keys are never overwritten")
    if not out["server_secret"].exists():
        public, secret = zmq.curve_keypair()
        _write(out["server_secret"], public, secret)
        _write(out["server_key"], public, None)
    load_key_pair(out["server_secret"])  # a damaged shard pair fails here, not at start
    public, secret = zmq.curve_keypair()
    _write(out["client_secret"], public, secret)
    _write(out["client_key"], public, None)
    _write(out["allowed"], public, None)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``bitps-keygen DIR [--name NAME]``: print the files written; exit 1 when refused."""
    p = argparse.ArgumentParser(prog="bitps-keygen", description=(
        "Write CURVE key pairs for bitps: the shards' (server.key, server.key_secret; kept "
        "when present) and one client's (NAME.key, NAME.key_secret, allowed/NAME.key)."))
    p.add_argument("directory", metavar="DIR", help="where the key files go (made if missing)")
    p.add_argument("--name", default="client", help="the client pair's file stem")
    args = p.parse_args(argv)
    try:
        paths = keygen(args.directory, args.name)
    except (OSError, ValueError) as err:
        print(f"bitps-keygen: {err}", file=sys.stderr)
        return 1
    for role, path in paths.items():
        print(f"{role:14} {path}")
    print(f"shards:  --curve-secret-key {paths['server_secret']} --curve-allowed-keys "
          f"{paths['allowed'].parent}\nworkers: --curve-server-key {paths['server_key']} "
          f"--curve-client-key {paths['client_secret']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
