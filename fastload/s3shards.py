"""Remote shards behind the node cache: :class:`RemoteShard`, and the S3 store (:data:`S3`).

A remote shard is an object on a store (:class:`Store`: an S3-compatible object store here, an
http(s) server in :mod:`fastload.httpshards`) read from a whole copy in a
:class:`~fastload.shardcache.ShardCache`. ``s3://bucket/prefix/train-{0000..0146}.tar`` (a brace
pattern), a list of such URLs, or ``s3://bucket/prefix/`` (every ``*.tar`` object directly under the prefix,
listed, sorted by key) name the shards. :func:`remote_sources` looks each one up when the dataset is
made (its size and ETag, so a missing shard or bucket is an error then, naming it) and fetches the
``<shard>.idx`` object beside it where there is one (its index, checked against the shard's size
and ETag before use); each :class:`RemoteShard` reads from a whole copy of its object in the cache,
downloaded on first use (once per node) and, in a background thread, the next shards of the
listing ahead of the readers.

The client is botocore's (``pip install 'fastload[s3]'``), one per process (made again after
``fork``), configured only by the standard AWS environment and files: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (or ``AWS_PROFILE`` and ``~/.aws/credentials``, SSO, instance roles),
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for an S3-compatible store, ``AWS_REGION`` /
``AWS_DEFAULT_REGION`` or ``~/.aws/config``. fastload takes no credential argument and never
writes one into a message.

Transient failures (connection refused or reset, timeouts, 5xx answers, throttling) are retried
with exponential backoff (0.25 s doubling to 8 s, with jitter) for ``retry_timeout`` seconds in
all, then :class:`ObjectStoreError` names the shard, the endpoint and the last error. Each attempt
waits at most :func:`attempt_timeout` for the store to connect or send the next bytes, so a store
that accepts connections but stops answering is an error after about ``retry_timeout`` too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol, TypeVar

from .shardcache import ShardCache
from .shardsource import read_fully

__all__ = [
    "S3",
    "ObjectStoreError",
    "RemoteShard",
    "Store",
    "attempt_timeout",
    "follow_order",
    "is_remote_url",
    "remote_sources",
    "retrying",
    "start_prefetch",
    "tag_number",
    "upload",
]

#: Seconds of retries (in all, per download or lookup) before a transient failure is an error.
RETRY_TIMEOUT = 60.0
_FIRST_DELAY, _MAX_DELAY = 0.25, 8.0
_MIN_WAIT, _MAX_WAIT = 1, 60
_CHUNK = 1 << 20
_THROTTLED = {
    "Throttling",
    "ThrottlingException",
    "SlowDown",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
}
_DENIED = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "403",
    "Forbidden",
}
_T = TypeVar("_T")
_retry_timeout = threading.local()  # (the retry_timeout of the retrying call under way in a thread)


class ObjectStoreError(OSError):
    """The object store (or http(s) server) did not answer, or kept failing, for longer than
    ``retry_timeout``."""


def is_remote_url(text: object) -> bool:
    """Whether ``text`` names shards on an object store or a server (``s3://``, ``http(s)://``)."""
    return isinstance(text, str) and text.startswith(("s3://", "http://", "https://"))


def tag_number(tag: str) -> int:
    """A shard's version tag (its ETag) as the number in its stamp: an index holds it."""
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "big")


class Store(Protocol):
    """Where remote shards are: each method is one attempt (:func:`retrying` repeats it)."""

    def where(self, url: str) -> str:
        """How messages name the store of ``url`` (e.g. ``the object store at http://...``)."""
        ...

    def identity(self, url: str) -> str:
        """What, with the version tag and size, names the cache's copy of ``url``."""
        ...

    def lookup(self, url: str) -> tuple[int, str]:
        """``(size, version tag)`` of the object ``url`` now."""
        ...

    def listing(self, url: str) -> list[tuple[str, int, str]]:
        """``(url, size, tag)`` of every object under the prefix ``url`` (ending in ``/``)."""
        ...

    def get(self, url: str, f: BinaryIO, tag: str | None) -> None:
        """Writes the object into ``f``; ``tag``: the version it must still be (else ``ESTALE``)."""
        ...

    def final(self, error: BaseException, what: str, url: str) -> BaseException | None:
        """The error to raise for a failure that retrying does not mend (``None``: not one)."""
        ...

    def transient(self, error: BaseException) -> bool:
        """Whether ``error`` may pass (a connection refused or reset, a timeout, a 5xx answer)."""
        ...


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"the shard URL {url!r} names no bucket: write s3://bucket/path/shard.tar")
    return bucket, key


# ----------------------------------------------------------------------------------------- client

_clients: dict[tuple[int, tuple[tuple[str, str], ...], int], Any] = {}
_clients_lock = threading.Lock()


def _botocore() -> Any:
    try:
        import botocore.config
        import botocore.exceptions
        import botocore.session
    except ImportError:
        raise ImportError(
            "reading shards from s3:// needs botocore, which is not installed: pip install 'fastload[s3]'"
        ) from None
    return botocore


def attempt_timeout() -> int:
    """Seconds one attempt may wait for the store to connect or to send the next bytes: the
    ``retry_timeout`` of the :func:`retrying` call under way in this thread, at least 1 and at most
    60 (60 outside one)."""
    return min(_MAX_WAIT, max(_MIN_WAIT, math.ceil(getattr(_retry_timeout, "value", _MAX_WAIT))))


def client() -> Any:
    """This process's S3 client for the AWS environment as it is now (a new one after ``fork``: a
    client's connections are not shared with another process), waiting :func:`attempt_timeout`
    seconds at most. Its retries are fastload's own (:func:`retrying`), so botocore's are off."""
    # (one per process, AWS environment and timeout: a process that sets AWS_PROFILE gets a client for it)
    timeout = attempt_timeout()
    key = (os.getpid(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))), timeout)
    made = _clients.get(key)
    if made is not None:
        return made
    botocore = _botocore()
    with _clients_lock:
        made = _clients.get(key)
        if made is None:
            config = botocore.config.Config(
                retries={"total_max_attempts": 1},
                connect_timeout=timeout,
                read_timeout=timeout,
                max_pool_connections=32,
            )
            made = botocore.session.get_session().create_client("s3", config=config)
            for other in [k for k in _clients if k[:2] != key[:2]]:
                del _clients[other]  # (a parent's client, in a forked process, is never used)
            _clients[key] = made
    return made


def _endpoint() -> str:
    try:
        return str(client().meta.endpoint_url)
    except Exception:  # noqa: BLE001 - only for messages
        return "the configured endpoint"


def _code(error: BaseException) -> tuple[str, int]:
    response = getattr(error, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _transient(error: BaseException) -> bool:
    botocore = _botocore()
    ex = botocore.exceptions
    if isinstance(error, ex.ClientError):
        code, status = _code(error)
        return status >= 500 or status == 429 or code in _THROTTLED
    transient = (
        ex.EndpointConnectionError,
        ex.ConnectionError,
        ex.ConnectTimeoutError,
        ex.ReadTimeoutError,
        ex.ResponseStreamingError,
        ex.IncompleteReadError,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(error, transient):
        return True
    return type(error).__module__.startswith("urllib3") or (
        isinstance(error, OSError) and error.errno in (errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE)
    )


def _final(error: BaseException, what: str, url: str) -> BaseException | None:
    """The error to raise for a failure that retrying does not mend (``None``: not one of those)."""
    botocore = _botocore()
    if isinstance(error, botocore.exceptions.NoCredentialsError):
        return PermissionError(
            errno.EACCES,
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
            "with ~/.aws/credentials",
            url,
        )
    if not isinstance(error, botocore.exceptions.ClientError):
        return None
    code, status = _code(error)
    if code == "NoSuchBucket":
        return _no_bucket(_split(url)[0])
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        return FileNotFoundError(
            errno.ENOENT, f"shard not found in the object store at {_endpoint()} (check the name)", url
        )
    if code in _DENIED or status == 403:
        return PermissionError(
            errno.EACCES,
            f"the object store at {_endpoint()} refused to {what} ({code or status}): check the "
            "credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and "
            "~/.aws/credentials) and that they may read the bucket",
            url,
        )
    if code == "PreconditionFailed" or status == 412:
        return OSError(
            errno.ESTALE,
            "the shard was written again since the dataset was made: create the dataset again",
            url,
        )
    return None


def _no_bucket(bucket: str) -> FileNotFoundError:
    return FileNotFoundError(
        errno.ENOENT,
        f"the bucket does not exist at {_endpoint()}: check the URL, and AWS_ENDPOINT_URL for an "
        "S3-compatible store",
        f"s3://{bucket}",
    )


def retrying(
    fn: Callable[[], _T], what: str, url: str, retry_timeout: float, store: Store | None = None
) -> _T:
    """``fn()``, again after transient failures of ``store`` (default: :data:`S3`; exponential
    backoff with jitter) for at most ``retry_timeout`` seconds, each attempt waiting
    :func:`attempt_timeout` at most; then :class:`ObjectStoreError` naming ``url`` and the last
    error."""
    store = S3 if store is None else store
    start = time.monotonic()
    delay, attempts = _FIRST_DELAY, 0
    _retry_timeout.value = retry_timeout
    try:
        while True:
            attempts += 1
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - sorted into final, transient and unexpected below
                final = store.final(e, what, url)
                if final is not None:
                    raise final from None
                if not store.transient(e):
                    raise
                elapsed = time.monotonic() - start
                if elapsed + delay > retry_timeout:
                    raise ObjectStoreError(
                        errno.EIO,
                        f"could not {what} after {attempts} attempt(s) in {elapsed:.1f} s: "
                        f"{store.where(url)} kept failing (last error: {type(e).__name__}: {e}). Check "
                        "that it runs and can be reached; the next read tries again",
                        url,
                    ) from None
                time.sleep(delay * random.uniform(0.75, 1.25))
                delay = min(2 * delay, _MAX_DELAY)
    finally:
        del _retry_timeout.value


class _S3Store:
    """An S3-compatible object store, through botocore (see the module's description)."""

    def where(self, url: str) -> str:
        return f"the object store at {_endpoint()}"

    def identity(self, url: str) -> str:
        return f"{_endpoint()}\0{url}"

    def lookup(self, url: str) -> tuple[int, str]:
        bucket, key = _split(url)
        c = client()
        try:
            meta = c.head_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - a 404 may be the bucket's
            if _code(e)[1] == 404:
                try:
                    c.head_bucket(Bucket=bucket)
                except Exception as b:  # noqa: BLE001
                    if _code(b)[1] == 404:
                        raise _no_bucket(bucket) from None
            raise
        return int(meta["ContentLength"]), str(meta["ETag"])

    def listing(self, url: str) -> list[tuple[str, int, str]]:
        bucket, prefix = _split(url)
        pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [
            (f"s3://{bucket}/{item['Key']}", int(item["Size"]), str(item["ETag"]))
            for page in pages
            for item in page.get("Contents", ())
        ]

    def get(self, url: str, f: BinaryIO, tag: str | None) -> None:
        bucket, key = _split(url)
        body = client().get_object(Bucket=bucket, Key=key, **({"IfMatch": tag} if tag else {}))["Body"]
        try:
            for chunk in body.iter_chunks(_CHUNK):
                f.write(chunk)
        finally:
            body.close()

    def final(self, error: BaseException, what: str, url: str) -> BaseException | None:
        return _final(error, what, url)

    def transient(self, error: BaseException) -> bool:
        return _transient(error)


#: The S3-compatible object store of the AWS environment.
S3: Store = _S3Store()


def upload(path: str, url: str, retry_timeout: float = RETRY_TIMEOUT) -> str:
    """Writes the file ``path`` as the object ``url`` (one PUT, retried); returns its ETag."""
    bucket, key = _split(url)

    def put() -> str:
        with open(path, "rb") as f:
            return str(client().put_object(Bucket=bucket, Key=key, Body=f)["ETag"])

    return retrying(put, "upload the file", url, retry_timeout)


# ----------------------------------------------------------------------------------------- shards


class _Listing:
    """The shards of one dataset, in order (a shard prefetches the next ones of it)."""

    def __init__(self, cache: ShardCache, retry_timeout: float) -> None:
        self.cache, self.retry_timeout = cache, retry_timeout
        self.shards: list[RemoteShard] = []
        self.prefetching = False  # (off while the dataset is made: indexing reads every shard)


class RemoteShard:
    """A shard on a :class:`Store` (an object store, an http(s) server), read from its copy in
    the node-local cache.

    ``stamp()`` is ``(size, a number from the version tag)`` as looked up when the dataset was
    made (the ETag, or for a server without one its ``Last-Modified``), so an index kept beside the
    copy is valid for exactly that object. The first read in a process opens the copy (downloading
    it where the cache lacks it) and queues the next shards of the listing for download ahead, as
    many as fit in half the cache (at most ``cache.prefetch``).
    """

    def __init__(self, store: Store, url: str, size: int, tag: str, listing: _Listing, number: int) -> None:
        self.store, self.size, self.tag = store, int(size), tag
        self.name = self.key = url
        self._listing, self._number = listing, number
        identity = f"{store.identity(url)}\0{tag}\0{self.size}"
        self.copy = listing.cache.path(identity, url.rsplit("/", 1)[-1])
        self.sidecar: str | None = listing.cache.index_path(self.copy)
        self._tag_number = tag_number(tag)
        self._opened_in = 0

    def stamp(self) -> tuple[int, int]:
        return self.size, self._tag_number

    def _download(self, f: BinaryIO, since: float) -> None:
        """Downloads the shard into ``f``, unless a download of it by another reader (this one
        waiting for it since ``since``, ``time.time()``) failed meanwhile: its error then."""
        failure, text = self.copy + ".lock", ""  # (its text: the last failed download's error)
        with contextlib.suppress(OSError), open(failure) as last:
            text = last.read() if os.fstat(last.fileno()).st_mtime > since else ""
        if text:
            raise ObjectStoreError(errno.EIO, text, self.name)

        def attempt() -> None:
            f.seek(0)
            self.store.get(self.name, f, self.tag)
            if f.tell() != self.size:  # (a connection closed early: retried)
                raise ConnectionError(f"the download stopped at byte {f.tell()} of {self.size}")

        try:
            retrying(attempt, "download the shard", self.name, self._listing.retry_timeout, self.store)
        except ObjectStoreError as e:
            with contextlib.suppress(OSError), open(failure, "w") as last:
                last.write(str(e.strerror))  # (the readers waiting for this download fail with it)
            raise

    def fetch_index(self) -> None:
        """Copies the ``<shard>.idx`` object beside the shard into the cache, where the cache has
        no index of this shard yet (:func:`~fastload.tarindex.load_indexes` checks it against
        :meth:`stamp`, and builds it again where it does not match); none there: nothing."""
        path = self._listing.cache.index_path(self.copy)
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"

        def attempt() -> None:
            with open(tmp, "wb") as f:
                self.store.get(self.name + ".idx", f, None)

        try:
            retrying(
                attempt, "read the shard's index", self.name + ".idx", self._listing.retry_timeout, self.store
            )
            os.replace(tmp, path)
        except (FileNotFoundError, PermissionError):
            pass  # (none beside the shard, or S3's 403 for a missing key: built from the shard)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def fetch(self) -> None:
        """Makes sure the copy is in the cache (downloading it if need be)."""
        cache = self._listing.cache
        since = time.time()
        os.close(cache.ensure(self.copy, self.size, self.name, lambda f: self._download(f, since)))

    def read(self, offset: int, length: int) -> bytes:
        cache = self._listing.cache
        since = time.time()
        handle = cache.open(self.copy, self.size, self.name, lambda f: self._download(f, since))
        fd = handle.fd
        if self._opened_in != os.getpid() and self._listing.prefetching:
            self._opened_in = os.getpid()
            self._prefetch()
        data = read_fully(fd, offset, length)
        del handle
        return data

    def _prefetch(self) -> None:
        listing = self._listing
        budget = listing.cache.limit // 2
        after = []
        for shard in listing.shards[self._number + 1 : self._number + 1 + listing.cache.prefetch]:
            budget -= shard.size
            if budget < 0:
                break
            after.append(shard)
        if after:
            listing.cache.prefetch_after([s.fetch for s in after], [s.copy for s in after])

    def __repr__(self) -> str:
        return f"RemoteShard({self.name!r})"


def start_prefetch(shards: Sequence[object]) -> None:
    """From now on, the first read of a :class:`RemoteShard` in a process downloads the next ones
    ahead (and the copies opened to index the shards are closed: indexing read every one)."""
    for shard in shards:
        if isinstance(shard, RemoteShard):
            shard._listing.prefetching = True
            shard._listing.cache.close()
            shard._opened_in = 0


def follow_order(shards: Sequence[object]) -> ShardCache | None:
    """The cache of the :class:`RemoteShard` s among ``shards`` (``None``: none is), whose first reads
    no longer queue the next shards of the listing (in this process and those it starts from now
    on): a loader that knows the pass's order downloads ahead in that order instead
    (:class:`~fastload.shardcache.OrderedPrefetch`)."""
    remote = [s for s in shards if isinstance(s, RemoteShard)]
    for shard in remote:
        shard._listing.prefetching = False
    return remote[0]._listing.cache if remote else None


def _scheme(url: object) -> str:
    return "http(s)://" if isinstance(url, str) and url.startswith(("http://", "https://")) else "s3://"


def _urls(shards: str | Sequence[str], expand: Callable[[str], list[str]]) -> list[str] | str:
    """The shard URLs named, or a prefix to list (ending in ``/``)."""
    if isinstance(shards, str):
        if shards.endswith("/"):
            if _scheme(shards) == "s3://":
                _split(shards)
            return shards
        return expand(shards) if "{" in shards else [shards]
    urls = list(shards)
    scheme = _scheme(urls[0])
    bad = [u for u in urls if not is_remote_url(u) or _scheme(u) != scheme]
    if bad:
        raise ValueError(
            f"shards mixes {scheme} URLs with other paths ({bad[0]!r}): list shards of one place, or "
            "copy them to one place"
        )
    if len(set(urls)) != len(urls):
        twice = next(u for u in urls if urls.count(u) > 1)
        raise ValueError(f"the shard {twice!r} is listed twice in shards: list each shard once")
    return urls


def remote_sources(
    shards: str | Sequence[str],
    store: Store,
    cache: ShardCache,
    *,
    expand: Callable[[str], list[str]],
    retry_timeout: float = RETRY_TIMEOUT,
    num_threads: int = 16,
) -> list[RemoteShard]:
    """The :class:`RemoteShard` of each shard named on ``store`` (see the module's description),
    looked up now, with the index objects beside them copied into the cache.

    Raises:
        FileNotFoundError: Naming a missing shard, or a missing bucket, or a prefix without shards.
        PermissionError: Credentials refused (the message names neither key nor secret).
        ObjectStoreError: The store did not answer within ``retry_timeout`` seconds.
        ImportError: botocore is not installed (``pip install 'fastload[s3]'``).
    """
    listing = _Listing(cache, retry_timeout)
    named = _urls(shards, expand)
    indexed: set[str] | None = None  # the shards with an index beside them (None: not known)

    def look(url: str) -> tuple[str, int, str] | FileNotFoundError:
        try:
            return (url, *retrying(lambda: store.lookup(url), "look the shard up", url, retry_timeout, store))
        except FileNotFoundError as e:
            return e

    with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="fastload-shards") as pool:
        if isinstance(named, str):
            objects = retrying(lambda: store.listing(named), "list the shards", named, retry_timeout, store)
            objects = [o for o in objects if "/" not in o[0][len(named) :]]  # (not in sub-folders)
            found = sorted(o for o in objects if o[0].lower().endswith(".tar"))
            indexed = {o[0][: -len(".idx")] for o in objects if o[0].lower().endswith(".tar.idx")}
            if not found:
                raise FileNotFoundError(
                    errno.ENOENT,
                    "no .tar object under this prefix: upload the shards (python -m fastload shards SRC "
                    "s3://bucket/prefix/ writes them) or check the prefix",
                    named,
                )
        else:
            looked = list(pool.map(look, named))
            missing = [r for r in looked if isinstance(r, FileNotFoundError)]
            if missing:
                first = missing[0]
                if len(missing) > 1 and first.filename != missing[1].filename:  # (not a missing bucket)
                    what = (
                        f"{len(missing)} of the {len(named)} shards named are not in {store.where(named[0])}"
                    )
                    raise FileNotFoundError(first.errno, f"{what}, the first", first.filename)
                raise first
            found = [r for r in looked if not isinstance(r, FileNotFoundError)]
        listing.shards = [RemoteShard(store, *f, listing=listing, number=k) for k, f in enumerate(found)]
        wanted = [s for s in listing.shards if indexed is None or s.name in indexed]
        list(pool.map(RemoteShard.fetch_index, wanted))
    return listing.shards
