"""replayrl.storage.s3: which failures are retried, what the user is told, and that no secret leaks."""

from __future__ import annotations

import pytest

from replayrl.errors import ReplayRLError
from replayrl.storage.s3 import classify, clean, explain, retry

pytestmark = pytest.mark.unit

# Messages as pyarrow and delta-rs (object_store) print them.
REFUSED = (
    "Generic S3 error: Error performing GET http://127.0.0.1:9/b/k in 2.1s, after 10 "
    "retries - HTTP error \x1b[31m↳\x1b[0m tcp connect error \x1b[31m↳\x1b[0m Connection refused"
)
DENIED = (
    "When reading information for key 'k' in bucket 'b': AWS Error ACCESS_DENIED during "
    "HeadObject operation: No response body."
)
SIGNATURE = "AWS Error SIGNATURE_DOES_NOT_MATCH during CreateMultipartUpload operation"
NO_BUCKET = (
    "AWS Error NO_SUCH_BUCKET during PutObject operation: The specified bucket does not exist"
)
HEX_ID = "Parquet magic bytes not found (Request ID: 18ECAE0709503B5F)"


@pytest.mark.parametrize(
    "message,kind",
    [
        (REFUSED, "transient"),
        ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7", "transient"),
        ("Server returned non-2xx status code: 503 Service Unavailable", "transient"),
        (DENIED, "credentials"),
        (SIGNATURE, "credentials"),
        (NO_BUCKET, "bucket"),
        (HEX_ID, "other"),  # "503" inside a request id is not an HTTP status
    ],
)
def test_classify(message, kind):
    assert classify(OSError(message)) == kind


def test_clean_strips_colours_and_secrets():
    text = clean(f"bad {REFUSED} key=SuperSecret123", secrets=["SuperSecret123", ""])
    assert "\x1b" not in text and "SuperSecret123" not in text and "***" in text
    assert "\n" not in clean("a\n  b") and len(clean("x" * 5000)) < 700


def test_explain_names_the_object_and_the_fix():
    err = explain(OSError(DENIED), action="read", uri="s3://b/k", endpoint="http://h:1")
    assert "s3://b/k" in str(err) and "AWS_SECRET_ACCESS_KEY" in str(err)
    err = explain(OSError(NO_BUCKET), action="write", uri="s3://b/k", endpoint=None)
    assert "bucket 'b' does not exist" in str(err) and "aws s3 mb s3://b" in str(err)


def test_retry_backs_off_until_the_store_answers():
    sleeps: list[float] = []
    attempts = iter([OSError(REFUSED), OSError(REFUSED), OSError(REFUSED), "ok"])

    def flaky():
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    result = retry(
        flaky, action="read", uri="s3://b/k", endpoint=None, deadline_s=60, sleep=sleeps.append
    )
    assert result == "ok" and sleeps == [0.2, 0.4, 0.8]


def test_retry_gives_up_at_the_deadline_and_fails_fast_on_permanent_errors():
    sleeps: list[float] = []

    def down():
        raise OSError(REFUSED)

    with pytest.raises(ReplayRLError, match="stayed unreachable.*rerun the same command"):
        retry(down, action="read", uri="s3://b/k", endpoint=None, deadline_s=0, sleep=sleeps.append)
    assert sleeps == []

    def denied():
        raise OSError(DENIED)

    with pytest.raises(ReplayRLError, match="rejected the credentials"):
        retry(
            denied, action="read", uri="s3://b/k", endpoint=None, deadline_s=60, sleep=sleeps.append
        )
    assert sleeps == []
    with pytest.raises(FileNotFoundError):  # a missing object is the caller's business
        retry(
            lambda: (_ for _ in ()).throw(FileNotFoundError("k")),
            action="read",
            uri="s3://b/k",
            endpoint=None,
            deadline_s=60,
        )
