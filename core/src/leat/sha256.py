"""SHA-256 by CPython's own code, the module hashlib falls back to: the same digests without OpenSSL.

``import hashlib`` loads OpenSSL's libcrypto (3.5 MiB resident) whether the process hashes or not. What leat hashes
on the way to a token (prefix-cache keys, a session fingerprint, a kernel cache key, an image) is short; whole files
(pulls, verification) go through hashlib, imported where they are hashed.
"""

try:
    from _sha2 import sha256  # CPython 3.12+
except ImportError:
    try:
        from _sha256 import sha256  # CPython 3.11
    except ImportError:  # a Python without them
        from hashlib import sha256

__all__ = ["sha256"]
