"""Sorting SQS, SNS and botocore failures into the relay's failure classes.

One table per class, checked in a fixed order, for three kinds of failure: a whole
``SendMessageBatch`` or ``PublishBatch`` call refused (:func:`classify_client_error`), one
entry refused inside a successful call (:func:`classify_entry`), and no answer at all
(:func:`classify_transport_error`). The two services share most codes (the batch-shape
ones, throttling, credentials); where SNS spells one of its own (``NotFound``,
``AuthorizationError``, ``KMSDisabled``, ``InvalidParameter``) it sits in the same table as
SQS's, so one classification serves both.

SQS codes arrive in two spellings. The query protocol's (``AWS.SimpleQueueService.NonExistentQueue``,
``KMS.DisabledException``) travel in the ``x-amzn-query-error`` header and end up in
``Error.Code``; the JSON protocol's shape names (``QueueDoesNotExist``, ``KmsDisabled``) end
up in ``Error.QueryErrorCode`` (botocore's naming is inverted). Both are looked up. SNS
speaks the query protocol only: its code is ``Error.Code``.

The HTTP status decides nothing on its own: SQS answers throttling with a 403
(``RequestThrottled``), so "4xx is permanent" would send throttled messages to 'dead'.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProxyConnectionError,
    ReadTimeoutError,
    SSLError,
)

if TYPE_CHECKING:
    from mypy_boto3_sns.type_defs import BatchResultErrorEntryTypeDef as SnsEntryError
    from mypy_boto3_sqs.type_defs import BatchResultErrorEntryTypeDef as SqsEntryError

FaultKind = Literal["retry", "permanent", "outage", "split"]
"""``retry``: transient, the attempt counts (RetryableError).
``permanent``: this message can never go (PermanentError), once it has been sent alone.
``outage``: the queue or topic refuses every message, whatever the message (BrokerUnavailable).
``split``: the request was badly shaped by the relay itself; send its entries in smaller requests."""

# Too many requests for SQS, SNS or the destination's KMS key: wait and try again.
THROTTLING = frozenset(
    {
        "RequestThrottled",
        "Throttled",  # SNS
        "KMSThrottling",  # SNS
        "ThrottlingException",
        "Throttling",
        "ThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "SlowDown",
        "OverLimit",
        "KmsThrottled",
        "KMS.ThrottlingException",
    }
)

# The service's own trouble (also any 5xx), and a KMS key that is only momentarily unavailable.
SERVER = frozenset(
    {
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "RequestTimeout",
        "RequestTimeoutException",
        "KMS.KeyUnavailableException",
        "KMS.DependencyTimeoutException",
        "KMS.KMSInternalException",
    }
)

# The queue or topic, its key or the credentials are wrong: every message would fail the
# same way, so none is the message's fault and none may go to 'dead' for it.
QUEUE_MISSING = frozenset({"NonExistentQueue", "QueueDoesNotExist"})
TOPIC_MISSING = frozenset({"NotFound", "NotFoundException"})  # SNS
CREDENTIALS = frozenset(
    {
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "MissingAuthenticationToken",
        "InvalidAccessKeyId",
        "ExpiredToken",
        "ExpiredTokenException",
        "AuthFailure",
    }
)
ACCESS_DENIED = frozenset({"AccessDenied", "AccessDeniedException", "AuthorizationError"})
OUTAGE = (
    QUEUE_MISSING
    | TOPIC_MISSING
    | CREDENTIALS
    | ACCESS_DENIED
    | frozenset(
        {
            "KmsDisabled",
            "KMS.DisabledException",
            "KmsNotFound",
            "KMS.NotFoundException",
            "KmsAccessDenied",
            "KMS.AccessDeniedException",
            "KmsInvalidState",
            "KMS.InvalidStateException",
            "KmsInvalidKeyUsage",
            "KMS.InvalidKeyUsageException",
            "KmsOptInRequired",
            "KMS.OptInRequired",
            # SNS's spellings of the same KMS faults
            "KMSDisabled",
            "KMSNotFound",
            "KMSAccessDenied",
            "KMSInvalidState",
            "KMSOptInRequired",
            "InvalidSecurity",
            "InvalidAddress",
            "OptInRequired",
            "RequestExpired",  # the host's clock is off: every signature is refused
            "UnsupportedOperation",
        }
    )
)

# Requests the relay itself built wrong (too many entries, too many bytes, an Id twice).
# Every entry may be fine on its own, so the entries are resent in smaller requests.
REQUEST_SHAPE = frozenset(
    {
        "TooManyEntriesInBatchRequest",
        "BatchRequestTooLong",
        "BatchEntryIdsNotDistinct",
        "InvalidBatchEntryId",
        "EmptyBatchRequest",
    }
)

# Something in a message SQS or SNS will never take: too long, characters outside its allowed
# set, an attribute or parameter it refuses. When a whole request is refused for this the
# culprit is unknown, so a request of several entries is split until it is found.
CONTENT = frozenset(
    {
        "InvalidMessageContents",
        "MessageTooLong",
        "InvalidParameterValue",
        "InvalidParameter",  # SNS
        "ParameterValueInvalid",  # SNS
        "InvalidParameterCombination",
        "InvalidParameterException",
        "MissingParameter",
        "MissingRequiredParameterException",
        "InvalidAttributeValue",
        "InvalidAttributeName",
        "ValidationError",
        "ValidationException",
    }
)

_PREFIXES = ("AWS.SimpleQueueService.", "com.amazonaws.sqs#", "com.amazonaws.sns#")


@dataclass(frozen=True)
class Fault:
    """One classified failure: its class, the code that decided it, and the service's words."""

    kind: FaultKind
    code: str
    detail: str
    content: bool = False  # the request was refused for what one of its messages holds

    def text(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


def normalize(code: str | None) -> str:
    """``AWS.SimpleQueueService.NonExistentQueue`` -> ``NonExistentQueue``; ``None`` -> ``""``."""
    if not code:
        return ""
    for prefix in _PREFIXES:
        if code.startswith(prefix):
            return code[len(prefix) :]
    return code


def _first(codes: Iterable[str], table: frozenset[str]) -> str | None:
    return next((c for c in codes if c in table), None)


def classify_client_error(exc: ClientError) -> Fault:
    """Classify a call (``SendMessageBatch``, ``PublishBatch``, the start-up probes) refused as a whole."""
    error = exc.response.get("Error", {})
    # QueryErrorCode is botocore's addition, outside the typed shape of Error.
    raw = [error.get("Code"), dict(error).get("QueryErrorCode")]
    codes = [normalize(c) for c in raw if isinstance(c, str) and c]
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    detail = str(error.get("Message", "")).strip()
    code = codes[0] if codes else f"HTTP {status}"
    if found := _first(codes, THROTTLING):
        return Fault("retry", found, detail)
    if found := _first(codes, OUTAGE):
        return Fault("outage", found, detail)
    if found := _first(codes, REQUEST_SHAPE):
        return Fault("split", found, detail)
    if found := _first(codes, CONTENT):
        return Fault("permanent", found, detail, content=True)
    if found := _first(codes, SERVER):
        return Fault("retry", found, detail)
    # An unknown code, 5xx or not: retry, so that the attempt limit (not a guess) decides
    # when to give up, and the code stays in last_error for a person to read.
    return Fault("retry", code, detail or f"HTTP {status}")


def classify_entry(entry: SqsEntryError | SnsEntryError) -> Fault:
    """Classify one ``Failed`` entry of a successful ``SendMessageBatch`` or ``PublishBatch`` call.

    Known codes decide first, because SQS has reported throttling with ``SenderFault``
    true; for any other code ``SenderFault`` decides: the sender's fault is permanent,
    the service's is retryable.
    """
    code = normalize(entry.get("Code")) or "UnknownError"
    detail = str(entry.get("Message", "")).strip()
    if code in THROTTLING or code in SERVER:
        return Fault("retry", code, detail)
    if code in OUTAGE:
        return Fault("outage", code, detail)
    if code in CONTENT:
        return Fault("permanent", code, detail, content=True)
    if code in REQUEST_SHAPE:  # not expected per entry; the entry itself is not at fault
        return Fault("retry", code, detail)
    if entry.get("SenderFault", False):
        return Fault("permanent", code, detail, content=True)
    return Fault("retry", code, detail)


def classify_transport_error(exc: BotoCoreError) -> Fault:
    """Classify a call that got no answer from SQS or SNS (or never left the client).

    Timeouts and dropped connections are retryable: the call may or may not have reached
    the service (a FIFO queue or topic collapses the resend; other consumers de-duplicate
    by ``outbox_id``). An endpoint that cannot be connected to at all (refused, DNS, TLS,
    proxy) and missing credentials are outages: no message is at fault, so none may
    spend attempts towards 'dead' while it lasts.
    """
    detail = str(exc)
    if isinstance(exc, ConnectTimeoutError):
        return Fault("retry", "ConnectTimeout", detail)
    if isinstance(exc, ReadTimeoutError):
        return Fault("retry", "ReadTimeout", detail)
    if isinstance(exc, ConnectionClosedError):
        return Fault("retry", "ConnectionClosed", detail)
    if isinstance(exc, SSLError):
        return Fault("outage", "TLSError", detail)
    if isinstance(exc, ProxyConnectionError):
        return Fault("outage", "ProxyError", detail)
    if isinstance(exc, EndpointConnectionError):
        return Fault("outage", "CannotConnect", detail)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return Fault("outage", "NoCredentials", detail)
    if isinstance(exc, ParamValidationError):
        # botocore refused to build the request from one of its entries.
        return Fault("permanent", "ParamValidation", detail, content=True)
    return Fault("retry", type(exc).__name__, detail)
