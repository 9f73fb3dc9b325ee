"""Signed receipts: what produced a response, signed with the server's Ed25519 key.

A receipt is a JSON object (schema in docs/api.md)::

    {"leat_receipt": 1, "alg": "Ed25519", "key_id": "<first 16 hex of sha256(raw public key)>",
     "claims": {...}, "signature": "<base64url of the signature over canonical(claims)>"}

``canonical(x)`` is ``json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``
in UTF-8. A whole (non-streamed) response carries its receipt in a top-level ``receipt`` field and
the claim ``body_sha256`` is the SHA-256 of canonical(response body without ``receipt``), so a
change to any value of the response, or to any byte of the receipt, fails verification.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from leat import __version__
from leat.errors import LeatError

VERSION = 1


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def body_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(canonical({k: v for k, v in body.items() if k != "receipt"})).hexdigest()


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def default_key_path() -> Path:
    from leat.pull import cache_dir

    return cache_dir() / "receipts" / "ed25519.pem"


def public_key_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.stem + ".pub.pem")


def load_or_create_key(path: str | Path | None = None) -> Ed25519PrivateKey:
    """The private key in ``path`` (PEM, PKCS#8), made (mode 0600) with its public key beside it if missing."""
    path = Path(path).expanduser() if path else default_key_path()
    if not path.exists():  # made whole under a private name, then linked: of processes racing, the first wins
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        temp = Path(name)
        try:
            os.link(temp, path)
        except FileExistsError:
            pass  # another process's key: read below
        finally:
            temp.unlink(missing_ok=True)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise LeatError(f"{path}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise LeatError(f"{path}: receipts need an Ed25519 key, this is a {type(key).__name__}")
    public = public_key_path(path)
    if not public.exists():
        fd, name = tempfile.mkstemp(dir=public.parent, prefix=f".{public.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
        os.chmod(name, 0o644)
        os.replace(name, public)
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    data = Path(path).expanduser().read_bytes()
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = Ed25519PublicKey.from_public_bytes(base64.b64decode(data.strip(), validate=True))
        except ValueError:
            raise LeatError(f"{path}: not a PEM public key or a base64 raw Ed25519 key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise LeatError(f"{path}: receipts are signed with Ed25519; this is a {type(key).__name__}")
    return key


class Signer:
    """Signs receipts for one served model; the model file's SHA-256 is computed once, in the background."""

    def __init__(self, key: Ed25519PrivateKey, model_file: Any, backend: str):
        self.key = key
        self.key_id = key_id(key.public_key())
        self.backend = backend
        self._model_file = model_file
        self._sha256: str | None = None
        self._hashing = threading.Thread(target=self._hash, name="leat-model-sha256", daemon=True)
        self._hashing.start()

    def _hash(self) -> None:
        self._sha256 = self._model_file.sha256()

    def model_sha256(self) -> str:
        self._hashing.join()
        return self._sha256 or ""

    body_hash = staticmethod(body_hash)

    def sign(self, claims: dict[str, Any]) -> dict[str, Any]:
        claims = {**claims, "leat_version": __version__}
        signature = self.key.sign(canonical(claims))
        return {
            "leat_receipt": VERSION,
            "alg": "Ed25519",
            "key_id": self.key_id,
            "claims": claims,
            "signature": base64.urlsafe_b64encode(signature).decode().rstrip("="),
        }


def verify(document: dict[str, Any], public: Ed25519PublicKey, text: str | None = None) -> dict[str, Any]:
    """Check a receipt, or a response body that carries one; returns the claims or raises :class:`LeatError`.

    With a response body, ``body_sha256`` must match the body; with ``text``, ``output_text_sha256`` must match it.
    """
    receipt = document.get("receipt", document) if isinstance(document, dict) else None
    if not isinstance(receipt, dict) or receipt.get("leat_receipt") != VERSION:
        raise LeatError("not a leat receipt (nor a response carrying one): no 'leat_receipt': 1")
    if receipt.get("alg") != "Ed25519":
        raise LeatError(f"unknown receipt algorithm {receipt.get('alg')!r}")
    claims = receipt.get("claims")
    if not isinstance(claims, dict):
        raise LeatError("receipt has no claims")
    if receipt.get("key_id") != key_id(public):
        raise LeatError(f"receipt was signed by key {receipt.get('key_id')}, not by this public key ({key_id(public)})")
    try:
        signature = base64.urlsafe_b64decode(str(receipt.get("signature", "")) + "==")
        public.verify(signature, canonical(claims))
    except (InvalidSignature, ValueError):
        raise LeatError(
            "signature does not match the claims: the receipt was altered or signed by another key"
        ) from None
    if document is not receipt:
        expected = claims.get("body_sha256")
        if expected is None:
            raise LeatError("this receipt does not cover a response body (it came from a streamed response)")
        if body_hash(document) != expected:
            raise LeatError("the response body does not match the receipt's body_sha256: the response was altered")
    if text is not None and hashlib.sha256(text.encode()).hexdigest() != claims.get("output_text_sha256"):
        raise LeatError("the text does not match the receipt's output_text_sha256")
    return claims
