"""Shards on an http(s) server: the :class:`~fastload.s3shards.Store` behind ``https://`` URLs.

``TarShards("https://host/path/train-{0000..0009}.tar")`` (or a list of URLs) reads each shard as
an :class:`~fastload.s3shards.RemoteShard`: looked up (``HEAD``: its size, and its ``ETag``, else
its ``Last-Modified``, which with the URL name its copy) when the dataset is made, downloaded
whole (``GET``) into the node cache on first use, once per node, like a shard on an object store.
A server is not listed: name the shards. ``404`` is a ``FileNotFoundError`` naming the URL;
connection failures, timeouts (each attempt waits
:func:`~fastload.s3shards.attempt_timeout` at most) and ``5xx``, ``408`` and ``429`` answers are
retried (see :func:`~fastload.s3shards.retrying`). Standard library only (``urllib``): no dependency.
"""

from __future__ import annotations

import errno
import http.client
import shutil
import socket
import urllib.error
import urllib.request
from email.message import Message
from typing import BinaryIO

from .s3shards import attempt_timeout

__all__ = ["HTTP"]

_CHUNK = 1 << 20


def _open(url: str, method: str = "GET") -> http.client.HTTPResponse:
    request = urllib.request.Request(url, method=method, headers={"User-Agent": "fastload"})
    response: http.client.HTTPResponse = urllib.request.urlopen(request, timeout=attempt_timeout())
    return response


def _tag(headers: Message) -> str:
    return headers.get("ETag") or headers.get("Last-Modified") or ""


class _HTTPStore:
    """Shards on an http(s) server (see the module's description)."""

    def where(self, url: str) -> str:
        scheme, _, rest = url.partition("://")
        return f"the server at {scheme}://{rest.split('/', 1)[0]}"

    def identity(self, url: str) -> str:
        return url

    def lookup(self, url: str) -> tuple[int, str]:
        with _open(url, "HEAD") as response:
            size = response.headers.get("Content-Length")
            if size is None or not size.isdigit():
                raise OSError(
                    errno.EPROTO,
                    f"{self.where(url)} gives no size (Content-Length) for the shard: serve it as a "
                    "file, or copy the shards to a local folder",
                    url,
                )
            return int(size), _tag(response.headers)

    def listing(self, url: str) -> list[tuple[str, int, str]]:
        raise ValueError(
            f"shards={url!r} names a folder on an http(s) server, which cannot be listed: name the "
            "shards with a brace pattern (https://host/path/train-{0000..0009}.tar) or a list of URLs"
        )

    def get(self, url: str, f: BinaryIO, tag: str | None) -> None:
        with _open(url) as response:
            if tag is not None and _tag(response.headers) != tag:
                raise OSError(
                    errno.ESTALE,
                    "the shard was written again since the dataset was made: create the dataset again",
                    url,
                )
            shutil.copyfileobj(response, f, _CHUNK)

    def final(self, error: BaseException, what: str, url: str) -> BaseException | None:
        reason = getattr(error, "reason", None)
        if isinstance(reason, socket.gaierror) and reason.errno == socket.EAI_NONAME:
            return OSError(
                errno.EHOSTUNREACH, f"{self.where(url)} is not known ({reason}): check the URL", url
            )
        if not isinstance(error, urllib.error.HTTPError):
            return None
        if error.code in (404, 410):
            return FileNotFoundError(
                errno.ENOENT, f"shard not found on {self.where(url)} (HTTP {error.code}): check the URL", url
            )
        if error.code in (401, 403):
            return PermissionError(
                errno.EACCES, f"{self.where(url)} refused to {what} (HTTP {error.code})", url
            )
        return None

    def transient(self, error: BaseException) -> bool:
        if isinstance(error, urllib.error.HTTPError):
            return error.code >= 500 or error.code in (408, 429)
        return isinstance(
            error, (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError)
        )


#: Shards on http(s) servers.
HTTP = _HTTPStore()
