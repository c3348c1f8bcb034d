"""Secrets kept out of logs, tracebacks and messages.

`install` makes every log record of every logger (botocore's request and signing logs,
urllib3's, MLflow's, ours) and every uncaught traceback pass through `redact` before it is
written, so `replayrl -v` can be pasted into an issue: botocore's debug log carries the
session token (`X-Amz-Security-Token`) and the `Authorization` header of each request, and
a URL may carry `user:password@`. `redact` removes two kinds of thing:

- the values of the known secrets: the environment variables in `SECRET_VARIABLES` (read
  from the mapping `install` is given, when each record is made, so a variable set later
  counts) and the values passed to `register` (a password a tracking URI carried);
- whatever looks like a credential wherever it appears: the password of a URL
  (`http://user:***@host`), the value of an `Authorization`, `Cookie` or
  `X-Amz-Security-Token` header, the signature of a signed request (`Signature=`,
  `X-Amz-Signature=`, botocore's `Signature:` line),
  and `password=` / `secret_access_key=` / `session_token=`-style assignments.

`without_credentials` is the URI to store or show: the same URI without its user and
password (state.json, MLflow params and the config artifact hold only that).

Knows nothing about storage, MLflow or configs: it is given the environment and the
values to hide. Values shorter than `MIN_SECRET_CHARS` are not replaced on their own (they
would hit ordinary words); the patterns still catch them where credentials are written.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# Environment variables whose values are secrets, wherever they show up.
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "KF_PIPELINES_TOKEN",
    "KF_PIPELINES_COOKIES",
    "HF_TOKEN",
)
MIN_SECRET_CHARS = 6
MASK = "***"

# scheme://user:password@ -> scheme://user:***@
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/@:'\"]*:)[^\s/@'\"]+@")
# Headers whose whole value is a credential: quoted (botocore prints headers as a dict of
# bytes, `'Authorization': b'AWS4-HMAC-SHA256 ...'`) or up to the end of the line.
_HEADER_NAMES = r"authorization|proxy-authorization|cookie|set-cookie|x-amz-security-token"
_QUOTED_HEADER = re.compile(
    rf"(?i)(?P<head>['\"]?\b(?:{_HEADER_NAMES})['\"]?\s*[:=]\s*b?)(?P<q>['\"])(?P<value>.*?)(?P=q)"
)
_LINE_HEADER = re.compile(rf"(?i)(?P<head>\b(?:{_HEADER_NAMES})\s*:\s*)(?P<value>[^\r\n'\"]+)")
# botocore.auth logs a request's signature on the line after "Signature:".
_SIGNATURE_LINE = re.compile(r"(?P<head>\bSignature:\s*)(?P<value>[0-9a-f]{16,})")
# name=value (a query string, a signed request's Authorization parts, a key=value line).
_ASSIGNED = re.compile(
    r"(?i)(?P<head>\b(?:x-amz-security-token|x-amz-signature|signature|password|passwd|"
    r"aws_secret_access_key|secret_access_key|secret_key|session_token|security_token|"
    r"access_token|api_key|mlflow_tracking_password|mlflow_tracking_token)\s*=\s*)"
    r"(?P<value>[^\s&'\",;}]+)"
)

_registered: set[str] = set()
_lock = threading.Lock()


def register(secret: str | None) -> None:
    """Hide `secret` from every record `install` redacts from now on (e.g. the password of
    a tracking URI, which no environment variable names)."""
    if secret and len(secret) >= MIN_SECRET_CHARS:
        with _lock:
            _registered.add(secret)


def known_secrets(environ: Mapping[str, str]) -> list[str]:
    """The values to hide: those of `SECRET_VARIABLES` in `environ` and the registered
    ones, longest first (so a secret containing another is replaced whole)."""
    values = {environ.get(name, "") for name in SECRET_VARIABLES} | set(_registered)
    return sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=len, reverse=True)


def redact(text: str, *, secrets: Iterable[str] = ()) -> str:
    """`text` with `secrets` and everything that looks like a credential replaced by ***.

    >>> redact("GET http://u:hunter22@mlflow:5000/api, Authorization: Basic dTpo")
    'GET http://u:***@mlflow:5000/api, Authorization: ***'
    """
    for secret in secrets:
        if secret and len(secret) >= MIN_SECRET_CHARS:
            text = text.replace(secret, MASK)
    text = _URL_PASSWORD.sub(rf"\g<head>{MASK}@", text)
    text = _QUOTED_HEADER.sub(rf"\g<head>\g<q>{MASK}\g<q>", text)
    text = _LINE_HEADER.sub(lambda m: m["head"] + MASK if m["value"] != MASK else m[0], text)
    text = _SIGNATURE_LINE.sub(rf"\g<head>{MASK}", text)
    return _ASSIGNED.sub(rf"\g<head>{MASK}", text)


def without_credentials(uri: str) -> str:
    """`uri` without its user and password: http://user:pw@host:5000/x -> http://host:5000/x.
    A URI without them (or not a URL: a path, sqlite:///...) is returned as it is."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class RedactSecrets(logging.Filter):
    """Rewrites a record's message, traceback and stack in place with `redact`; never drops
    a record. `environ` is read on every record (pass os.environ)."""

    def __init__(self, environ: Mapping[str, str]):
        super().__init__()
        self.environ = environ

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = known_secrets(self.environ)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string is logging's to report
            return True
        clean = redact(message, secrets=secrets)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, secrets=secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, secrets=secrets)
        return True


def install(environ: Mapping[str, str]) -> RedactSecrets:
    """Redact every record and uncaught traceback of this process from now on.

    The filter goes on the root logger's handlers (call this after `logging.basicConfig`)
    and into the record factory, so loggers with handlers of their own that do not
    propagate (MLflow's, made when mlflow is imported, later) are covered too; uncaught
    exceptions (sys.excepthook, threading.excepthook) print redacted. Idempotent."""
    current = logging.getLogRecordFactory()
    redactor = getattr(current, "redactor", None)
    if redactor is None:
        redactor = RedactSecrets(environ)

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = current(*args, **kwargs)
            redactor.filter(record)
            return record

        factory.redactor = redactor  # type: ignore[attr-defined]
        logging.setLogRecordFactory(factory)
        _install_excepthooks(environ)
    for handler in logging.getLogger().handlers:
        if redactor not in handler.filters:
            handler.addFilter(redactor)
    return redactor


def _install_excepthooks(environ: Mapping[str, str]) -> None:
    """Uncaught exceptions print as Python prints them, redacted."""

    def write(lines: list[str]) -> None:
        sys.stderr.write(redact("".join(lines), secrets=known_secrets(environ)))

    def excepthook(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        write(traceback.format_exception(kind, value, tb))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        trace = traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        write([f"Exception in thread {name}:\n", *trace])

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
