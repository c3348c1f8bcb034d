"""S3 plumbing for `storage`: error translation, retries under a deadline, conditional puts.

- `explain` turns an object-store failure (pyarrow, delta-rs or boto3) into a
  `ReplayRLError` that says which object, what kind of failure (wrong credentials, missing
  bucket, store unreachable) and the fix, with credentials redacted.
- `retry` reruns an idempotent operation while the failure is transient (connection
  refused or reset, timeouts, 5xx, throttling), backing off from `first_backoff_s` to
  `max_backoff_s`, until `deadline_s` has passed; permanent failures raise at once.
- `get_with_etag` / `put_if` read an object with its ETag and write it only if it still
  has that ETag (`If-Match`) or does not exist yet (`If-None-Match: *`): the S3
  conditional writes AWS, MinIO and SeaweedFS honour. They are the compare-and-swap under
  `storage.advance_state`.
- `check_conditional_writes` proves, once per process per store and run root, that the
  store honours those headers: a first `If-None-Match: *` put is accepted, a second one of
  the same key and a put with a stale `If-Match` ETag are rejected. A store that ignores
  them would turn the compare-and-swap into last-writer-wins, so it is refused with a
  ReplayRLError naming the ignored header.

Reads no environment variable and knows nothing about lineages: `storage` passes the
settings (endpoint, credentials, deadline) in. boto3 is imported only when a conditional
write is needed (the `s3` extra).
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from replayrl.errors import ReplayRLError

T = TypeVar("T")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A Rust backtrace delta-rs appends to its messages when RUST_BACKTRACE is set: numbered
# frames ("   0: <unknown>", "  12: start_thread\n      at ./nptl/...") to the end.
_BACKTRACE = re.compile(r"\n\s*0: .*\Z", re.S)
# HTTP 500/502/503/504 as a word, not inside a hex request id.
_HTTP_5XX = re.compile(r"\b50[0234]\b")
# Substrings of pyarrow / delta-rs (object_store) / botocore messages, lower-cased.
_CREDENTIALS = (
    "access_denied",
    "accessdenied",
    "access denied",
    "signature_does_not_match",
    "signaturedoesnotmatch",
    "invalid_access_key_id",
    "invalidaccesskeyid",
    "lacked the necessary privileges",
    "403 forbidden",
    "invalidtoken",
    "expiredtoken",
    "unable to locate credentials",
    "no credentials",
)
_BUCKET = ("no_such_bucket", "nosuchbucket", "bucket does not exist")
_TRANSIENT = (
    "connection refused",
    "couldn't connect",
    "could not connect",
    "network_connection",
    "connection reset",
    "connection aborted",
    "connection closed",
    "broken pipe",
    "timed out",
    "timeout",
    "tcp connect error",
    "error sending request",
    "endpoint url",  # botocore: Could not connect to the endpoint URL
    "service_unavailable",
    "serviceunavailable",
    "slow_down",
    "slowdown",
    "internal_failure",
    "internalerror",
    "curlcode: 7",
    "curlcode: 28",
    "curlcode: 52",
    "curlcode: 56",
)


def clean(message: str, *, secrets: Iterable[str] = ()) -> str:
    """One readable line: no terminal colours, no Rust backtrace, no credentials, at most
    ~600 characters."""
    text = " ".join(_BACKTRACE.sub("", _ANSI.sub("", message)).split())
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text if len(text) <= 600 else text[:600] + " …"


def classify(exc: BaseException) -> str:
    """'credentials', 'bucket', 'transient', 'missing' (no such object) or 'other'."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    code = _botocore_code(exc)
    text = f"{code} {exc}".lower()
    if any(m in text for m in _CREDENTIALS):
        return "credentials"
    if any(m in text for m in _BUCKET):
        return "bucket"
    if (any(m in text for m in _TRANSIENT) or _HTTP_5XX.search(text)) or exc.__class__.__name__ in (
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
    ):
        return "transient"
    if code in ("NoSuchKey", "404"):
        return "missing"
    return "other"


# Where the errors of the libraries at the storage edge are defined (`type(e).__module__`):
# pyarrow, delta-rs (its extension module is `_internal`), boto3/botocore and what they use.
_LIBRARY_MODULES = frozenset(
    {"pyarrow", "_internal", "deltalake", "botocore", "boto3", "s3transfer", "urllib3", "http"}
)


def is_library_error(exc: BaseException) -> bool:
    """Whether `exc` is an I/O or format error of the storage libraries (OSError and its
    kin, pyarrow's, delta-rs's, botocore's), which `explain` can put in words; False for
    anything else (a TypeError, an AttributeError: a bug, which must not be dressed up as
    a storage failure)."""
    if isinstance(exc, OSError):
        return True
    return any(
        c.__module__.split(".")[0] in _LIBRARY_MODULES
        for c in type(exc).__mro__
        if c not in (BaseException, Exception)
    )


def _botocore_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def bucket_of(uri: str) -> str:
    return uri[len("s3://") :].split("/", 1)[0] if uri.startswith("s3://") else ""


def explain(
    exc: BaseException,
    *,
    action: str,
    uri: str,
    endpoint: str | None,
    secrets: Iterable[str] = (),
    attempts: int | None = None,
    waited_s: float | None = None,
) -> ReplayRLError:
    """A ReplayRLError for `exc`, raised while trying to `action` `uri`."""
    kind = classify(exc)
    detail = clean(f"{exc.__class__.__name__}: {exc}", secrets=secrets)
    where = endpoint or "the default AWS endpoint"
    if kind == "credentials":
        return ReplayRLError(
            f"Cannot {action} '{uri}': the object store at {where} rejected the credentials "
            f"({detail}). Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) "
            f"and that they may read and write bucket '{bucket_of(uri)}'."
        )
    if kind == "bucket":
        return missing_bucket(action=action, uri=uri, endpoint=endpoint)
    if kind == "transient":
        tried = (
            f"for {waited_s:.0f} s ({attempts} attempts)"
            if waited_s is not None and attempts is not None
            else "until the retry deadline"
        )
        return ReplayRLError(
            f"Cannot {action} '{uri}': the object store at {where} stayed unreachable {tried}; "
            f"last error: {detail}. Nothing was half written; when the store is back, rerun "
            f"the same command to resume. REPLAYRL_S3_DEADLINE_S sets how long a step waits."
        )
    return ReplayRLError(f"Cannot {action} '{uri}': {detail}")


def missing_bucket(*, action: str, uri: str, endpoint: str | None) -> ReplayRLError:
    """The error for `uri` whose bucket does not exist (deleted, or a typo in the run root)."""
    where = endpoint or "the default AWS endpoint"
    return ReplayRLError(
        f"Cannot {action} '{uri}': bucket '{bucket_of(uri)}' does not exist at {where}. "
        f"Create it (e.g. `aws s3 mb s3://{bucket_of(uri)}`) or fix the run root."
    )


def retry(
    fn: Callable[[], T],
    *,
    action: str,
    uri: str,
    endpoint: str | None,
    deadline_s: float,
    secrets: Iterable[str] = (),
    first_backoff_s: float = 0.2,
    max_backoff_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, rerun on transient failures until `deadline_s` has passed. `fn` must be
    idempotent. Permanent failures (credentials, missing bucket, other) raise at once as a
    ReplayRLError; a missing object re-raises FileNotFoundError for the caller to handle;
    an exception that is not the storage libraries' (`is_library_error`: a bug) propagates
    as it is."""
    start = time.monotonic()
    backoff = first_backoff_s
    attempts = 0
    while True:
        attempts += 1
        try:
            return fn()
        except ReplayRLError:
            raise
        except Exception as exc:
            if not is_library_error(exc):
                raise
            kind = classify(exc)
            if kind == "missing" and isinstance(exc, FileNotFoundError):
                raise
            waited = time.monotonic() - start
            if kind != "transient" or waited + backoff > deadline_s:
                raise explain(
                    exc,
                    action=action,
                    uri=uri,
                    endpoint=endpoint,
                    secrets=secrets,
                    attempts=attempts,
                    waited_s=waited,
                ) from None
            sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)


# ---------------------------------------------------------------- conditional writes

# boto3 ships no types: a client is `Any` here.
_CLIENTS: dict[tuple[tuple[str, str], ...], Any] = {}


def client(settings: dict[str, str]) -> Any:
    """A boto3 S3 client for these settings (cached: building one costs ~50 ms)."""
    key = tuple(sorted(settings.items()))
    if key in _CLIENTS:
        return _CLIENTS[key]
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ReplayRLError(
            "An s3:// run root needs boto3 for its compare-and-swap of state.json: "
            "pip install 'replayrl[s3]'."
        ) from None
    endpoint = settings.get("AWS_ENDPOINT_URL")
    made = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=settings.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=settings.get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=settings.get("AWS_SESSION_TOKEN"),
        region_name=settings.get("AWS_REGION", "us-east-1"),
        config=Config(
            # Path-style works with every S3-compatible server; AWS itself picks its own.
            s3={"addressing_style": "path"} if endpoint else {},
            # One attempt per call: `retry` owns backoff and the deadline.
            retries={"max_attempts": 1, "mode": "standard"},
            connect_timeout=5,
            read_timeout=30,
        ),
    )
    _CLIENTS[key] = made
    return made


def split(uri: str) -> tuple[str, str]:
    """('bucket', 'key') of s3://bucket/key."""
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key


def get_with_etag(s3_client: Any, uri: str) -> tuple[bytes | None, str | None]:
    """The object's bytes and ETag, or (None, None) when it does not exist."""
    bucket, key = split(uri)
    try:
        response = s3_client.get_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if _botocore_code(exc) in ("NoSuchKey", "404"):
            return None, None
        raise
    return response["Body"].read(), response["ETag"]


def put_if(s3_client: Any, uri: str, data: bytes, *, etag: str | None) -> bool:
    """Write `data` only if the object still has `etag` (None: only if it does not exist).
    False when another writer got there first (412 Precondition Failed, 409 Conflict)."""
    bucket, key = split(uri)
    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    try:
        s3_client.put_object(
            Bucket=bucket, Key=key, Body=data, ContentType="application/json", **condition
        )
    except Exception as exc:
        code = _botocore_code(exc)
        status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        raise
    return True


def delete_object(s3_client: Any, uri: str) -> None:
    """Delete one object; nothing there is fine (S3 answers 204 either way)."""
    bucket, key = split(uri)
    s3_client.delete_object(Bucket=bucket, Key=key)


# ---------------------------------------------------------------- conditional-write probe

# Where the probe writes, under the run root. Lineage names never start with a dot, so it
# cannot collide with a lineage.
PROBE_DIR = ".replayrl-probe"
# (endpoint, run root) -> None when the store honours conditional writes, else the refusal.
_VERDICTS: dict[tuple[str, str], str | None] = {}


def check_conditional_writes(
    s3_client: Any,
    root: str,
    *,
    endpoint: str | None,
    deadline_s: float,
    secrets: Iterable[str] = (),
) -> None:
    """Refuse a store that ignores `If-None-Match: *` or `If-Match` on PutObject.

    Writes one probe object, `<root>/.replayrl-probe/<uuid>`, and checks that the store
    (a) accepts a first put with `If-None-Match: *`, (b) rejects a second such put of the
    same key and (c) rejects a put whose `If-Match` ETag is stale (after accepting one whose
    ETag is current); then deletes it. The verdict is cached per process for `(endpoint,
    root)`, so opening lineages again costs nothing. Transient failures are retried until
    `deadline_s` (each attempt with a fresh key); credentials and a missing bucket fail at
    once, as everywhere else. Example of a refusal (one line):

        The object store at http://s3.local:9000 (bucket 'runs') does not honour
        conditional writes: it ignored If-None-Match: * (a second create of the same key replaced the
        object instead of failing with 412 Precondition Failed). ...
    """
    secrets = list(secrets)
    verdict_key = (endpoint or "", root)
    if verdict_key in _VERDICTS:
        refusal = _VERDICTS[verdict_key]
        if refusal is not None:
            raise ReplayRLError(refusal)
        return
    probes: list[str] = []

    def attempt() -> list[str]:
        probes.append(f"{root}/{PROBE_DIR}/{uuid.uuid4().hex}")
        return _probe(s3_client, probes[-1])

    where = endpoint or "the default AWS endpoint"
    action = "check conditional writes at"
    failed = True
    try:
        ignored = retry(
            attempt,
            action=action,
            uri=root,
            endpoint=endpoint,
            deadline_s=deadline_s,
            secrets=secrets,
        )
        failed = False
    finally:
        for uri in probes:
            if failed:
                # Already failing: one quiet try, so the first error is the one reported.
                try:
                    delete_object(s3_client, uri)
                except Exception:  # noqa: BLE001 - a leftover probe object is harmless
                    pass
            else:
                retry(
                    functools.partial(delete_object, s3_client, uri),
                    action=action,
                    uri=root,
                    endpoint=endpoint,
                    deadline_s=deadline_s,
                    secrets=secrets,
                )
    refusal = None
    if ignored:
        refusal = (
            f"The object store at {where} (bucket '{bucket_of(root)}') does not honour "
            f"conditional writes: it {' and '.join(ignored)}. replayrl commits each iteration with a "
            f"compare-and-swap of state.json and guards a lineage with a lease, both conditional "
            f"puts; on this store they are last-writer-wins, so two runs could both advance a "
            f"lineage. Use a store that honours If-Match / If-None-Match on PutObject: AWS S3, "
            f"MinIO (late-2024 releases on), SeaweedFS 3.97 or later."
        )
    _VERDICTS[verdict_key] = refusal
    if refusal is not None:
        raise ReplayRLError(refusal)


def _probe(s3_client: Any, uri: str) -> list[str]:
    """What the store at `uri` (a fresh key) got wrong, as phrases; empty when nothing.
    A rejection is 412 Precondition Failed (or 409 Conflict), as `put_if` reads it."""
    try:
        created = put_if(s3_client, uri, b"probe 1", etag=None)
    except Exception as exc:
        if not is_library_error(exc) or classify(exc) != "other":
            raise  # credentials, bucket, transient: `retry` explains or retries it
        # e.g. 501 NotImplemented or 400 for a header the store does not know
        return [
            f"refused a first put of a new object with If-None-Match: * "
            f"({clean(f'{exc.__class__.__name__}: {exc}')})"
        ]
    if not created:
        return ["rejected a first put of a new object with If-None-Match: *"]
    ignored = []
    if put_if(s3_client, uri, b"probe 2", etag=None):
        ignored.append(
            "ignored If-None-Match: * (a second create of the same key replaced the object "
            "instead of failing with 412 Precondition Failed)"
        )
    _, current = get_with_etag(s3_client, uri)
    if not put_if(s3_client, uri, b"probe 3", etag=current):
        return [*ignored, "rejected a put whose If-Match ETag was current"]
    if put_if(s3_client, uri, b"probe 4", etag=current):  # `current` is stale now
        ignored.append(
            "ignored If-Match (a put with a stale ETag replaced the object instead of "
            "failing with 412 Precondition Failed)"
        )
    return ignored
