"""API keys for `kubetune serve`: `Authorization: Bearer <key>` on every route but the probes.

Keys come from `--api-key KEY` (repeatable), `--api-key-file PATH` (one key per line; blank
lines and `#` comments are ignored) and the environment: `KUBETUNE_API_KEY`, or vLLM's
`VLLM_API_KEY` so that a vLLM deployment moves over unchanged (each: one key, or several
separated by commas). With no key the server is open, as vLLM's is.

Everything except `/health`, `/ready` and `/metrics` needs a key (an allow-list, so a route
added later is protected without anyone remembering to). Kubelet probes and Prometheus carry
no key. A key is never logged: `describe` tells how many there are, not what they are.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kubetune.contracts.serving import HEALTH_PATH, METRICS_PATH, READY_PATH
from kubetune.errors import UserError
from kubetune.serve.http.protocol import error_body

API_KEY_ENV = "KUBETUNE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # what vLLM's OpenAI server reads
OPEN_PATHS = frozenset({HEALTH_PATH, READY_PATH, METRICS_PATH})


def load_api_keys(flags: Iterable[str], files: Iterable[Path], environ: Mapping[str, str]) -> tuple[str, ...]:
    """Every configured key, in order, without repeats; a missing or empty key file is a UserError."""
    keys = [_one_key(key, "--api-key") for key in flags]
    for path in files:
        keys += _read_key_file(path)
    for variable in (API_KEY_ENV, VLLM_API_KEY_ENV):
        keys += [key.strip() for key in environ.get(variable, "").split(",") if key.strip()]
    return tuple(dict.fromkeys(keys))


def _one_key(key: str, where: str) -> str:
    key = key.strip()
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise UserError(f"{where}: a key is one word of printable characters, without spaces (got an unusable one)")
    return key


def _read_key_file(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise UserError(f"--api-key-file {path}: cannot read it ({why}); give a file with one key per line") from None
    keys = [
        _one_key(line, f"--api-key-file {path}") for line in lines if line.strip() and not line.lstrip().startswith("#")
    ]
    if not keys:
        raise UserError(
            f"--api-key-file {path}: holds no key (one key per line; blank lines and # comments are ignored)"
        )
    return keys


def describe(keys: tuple[str, ...]) -> str:
    """The start-up line about authentication (never the keys themselves)."""
    if not keys:
        return "API keys: none, every route is open (--api-key, --api-key-file or KUBETUNE_API_KEY to require one)"
    return f"API keys: {len(keys)} configured; every route but {', '.join(sorted(OPEN_PATHS))} needs one"


def _digest(key: bytes) -> bytes:
    # Comparing fixed-length digests keeps the time independent of the key's length as well as
    # its content (compare_digest on unequal lengths returns at once).
    return hashlib.sha256(key).digest()


class ApiKeyAuth:
    """Pure ASGI: checks the header and passes the request on untouched (its body is never read)."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app = app
        self._digests = tuple(_digest(key.encode()) for key in keys)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not self._digests or scope["type"] == "lifespan" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        presented = _bearer(scope.get("headers") or [])
        if presented is not None and self.accepts(presented):
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # a websocket: refused before it is accepted
            return await send({"type": "websocket.close", "code": 1008})
        await _refuse(send, presented is None)

    def accepts(self, presented: bytes) -> bool:
        digest = _digest(presented)
        matched = False
        for known in self._digests:  # no early exit: the time does not tell which key matched
            matched |= hmac.compare_digest(digest, known)
        return matched


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first `Authorization: Bearer <token>` header (the scheme in any case), or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


async def _refuse(send: Any, missing: bool) -> None:
    if missing:
        message = "this server requires an API key: send the header `Authorization: Bearer <key>`"
        challenge = b"Bearer"
    else:
        message = "the API key is not valid for this server"
        challenge = b'Bearer error="invalid_token"'  # RFC 6750's answer to a wrong token
    body = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", challenge),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
