"""Image parts of requests: their bytes (from ``data:`` URLs or base64 sources), and :data:`leat.vision.MARKER`
where each stands in the message's text, which the chat template then places and the model's vision projector
fills (:meth:`leat_server.service.Service.render_chat`).

Remote image URLs are not fetched: a server that fetched what a request names could be made to reach hosts
only it can reach; a client sends the image's bytes inline instead.
"""

from __future__ import annotations

import base64
import binascii

from leat.vision import MARKER

from leat_server.errors import bad_request

MAX_IMAGE_BYTES = 20 << 20  # one image's encoded bytes
MAX_IMAGES = 16  # images in one request
NO_URLS = (
    "remote image URLs are not fetched by this server: send the image's bytes inline "
    "(OpenAI: a data:image/png;base64,... URL; Anthropic: a base64 source)"
)


class Images:
    """The encoded images of one request's messages, in order: :meth:`add` keeps one and returns its marker."""

    def __init__(self) -> None:
        self.data: list[bytes] = []

    def add(self, data: bytes, param: str) -> str:
        if len(self.data) >= MAX_IMAGES:
            raise bad_request(f"{param}: at most {MAX_IMAGES} images in one request", param)
        self.data.append(data)
        return MARKER

    def url(self, url: object, param: str) -> str:
        """An OpenAI ``image_url`` (a ``data:`` URL)."""
        if not isinstance(url, str) or not url:
            raise bad_request(f"{param}: an image part needs its url (a data: URL)", param)
        if url.startswith(("http://", "https://")):
            raise bad_request(f"{param}: {NO_URLS}", param)
        head, comma, payload = url.partition(",")
        if not head.startswith("data:") or not comma:
            raise bad_request(f"{param}: the image's url is not a data: URL; {NO_URLS}", param)
        if not head.endswith(";base64"):
            raise bad_request(f"{param}: a data: URL image must be base64 (data:image/png;base64,...)", param)
        return self.add(decode(payload, param), param)

    def source(self, source: dict, param: str) -> str:
        """An Anthropic image block's ``source`` (``{"type": "base64", "media_type", "data"}``)."""
        kind = source.get("type")
        if kind == "url":
            raise bad_request(f"{param}: {NO_URLS}", param)
        if kind != "base64" or not isinstance(source.get("data"), str):
            raise bad_request(f'{param}: an image source must be {{"type": "base64", "media_type", "data"}}', param)
        return self.add(decode(source["data"], param), param)


def decode(payload: str, param: str) -> bytes:
    """Base64 ``payload`` as bytes: a clear 400 when it is not base64 or is too large."""
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad_request(f"{param}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the image's data is not valid base64", param) from None
    if not data:
        raise bad_request(f"{param}: the image is empty", param)
    return data
