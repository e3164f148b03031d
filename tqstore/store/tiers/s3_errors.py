"""How the S3 tier turns boto exceptions into tqstore errors: no boto exception leaves the tier.

Four private outcomes (subclasses of RemoteError, caught inside S3Tier) carry the conditions the
tier handles itself: 412, 409, 404 and BadDigest.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import botocore.exceptions as bx
import urllib3.exceptions

from tqstore.errors import RemoteAuthError, RemoteError, RemoteUnreachable

_AUTH_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "AllAccessDisabled", "AccountProblem", "InvalidSecurity",
}
_DIGEST_CODES = {"BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest"}
_CREDENTIALS = (
    bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError,
    bx.SSOError, bx.TokenRetrievalError,
)
# Connection refused, DNS, timeouts, cut-off bodies: what botocore's own retries gave up on.
TRANSPORT = (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, urllib3.exceptions.HTTPError)


class PreconditionFailed(RemoteError):
    """412: an If-None-Match or If-Match condition did not hold."""


class ConditionalConflict(RemoteError):
    """409 ConditionalRequestConflict: a concurrent conditional write to the same key."""


class Missing(RemoteError):
    """404: no such key."""


class BadDigest(RemoteError):
    """400 BadDigest: the body arrived damaged (our ChecksumSHA256 did not match it)."""


@contextmanager
def boto_errors(operation: str, key: str, bucket: str, endpoint: str, attempts: int) -> Iterator[None]:
    """Re-raise any boto exception of the block as the matching tqstore error."""
    try:
        yield
    except bx.ClientError as exc:
        raise _client_error(exc, operation, key, bucket, endpoint) from exc
    except TRANSPORT as exc:
        raise unreachable(exc, endpoint, attempts) from exc
    except _CREDENTIALS as exc:
        raise RemoteAuthError(
            f"no usable S3 credentials for {endpoint} ({exc}): set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, as boto3 reads them"
        ) from exc
    except bx.NoRegionError as exc:
        raise RemoteError("no S3 region configured: set TQSTORE_S3_REGION (R2: auto)") from exc
    except bx.BotoCoreError as exc:
        raise RemoteError(f"S3 {operation} of {key} at {endpoint} failed: {exc}") from exc


def unreachable(exc: Exception | None, endpoint: str, attempts: int) -> RemoteUnreachable:
    """The error for an endpoint that did not answer."""
    return RemoteUnreachable(
        f"cannot reach S3 at {endpoint} after {attempts} attempts ({exc}): "
        "check TQSTORE_S3_ENDPOINT (s3.endpoint) and the network"
    )


def _client_error(exc: bx.ClientError, operation: str, key: str, bucket: str, endpoint: str) -> RemoteError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    detail = f"{code or status}: {error.get('Message', '')}".strip(": ")
    if code == "NoSuchBucket":
        return RemoteError(
            f"the bucket {bucket!r} does not exist at {endpoint}: create it, or fix "
            "TQSTORE_S3_URL (s3.url) and TQSTORE_S3_ENDPOINT (s3.endpoint)"
        )
    if code == "PreconditionFailed" or status == 412:
        return PreconditionFailed(f"{key}: {detail}")
    if code == "ConditionalRequestConflict" or status == 409:
        return ConditionalConflict(f"{key}: {detail}")
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        return Missing(f"{key}: {detail}")
    if code in _DIGEST_CODES:
        return BadDigest(f"{key}: {detail}")
    if code in _AUTH_CODES or status == 403:
        return RemoteAuthError(
            f"S3 at {endpoint} refused access to bucket {bucket!r} ({detail}): check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's permissions"
        )
    return RemoteError(f"S3 {operation} of {key} at {endpoint} failed ({detail})")
