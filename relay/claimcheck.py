"""Claim-check (``--claim-check-bucket``): a payload over ``--claim-check-threshold`` goes
to S3-compatible object storage, and the message carries a reference to it instead.

The object's key is derived from the event id (``<prefix><event id>``), so a retry, a
redelivery after a crash or a replay writes the same object again rather than a second
copy. The message keeps everything else (headers, order, ``aggregate_seq``,
de-duplication); its body becomes a small JSON reference, and two headers say where the
payload is and what it hashes to:

* ``dataref``: ``s3://<bucket>/<key>`` (with ``--envelope cloudevents``, the CloudEvents
  ``dataref`` extension attribute);
* ``datadigest``: ``sha-256=<base64 of the payload's SHA-256>``, for the consumer to check
  what it fetched.

The store failing (unreachable, a bucket missing, credentials refused) holds only the
messages that need it, as a destination of their own that is unavailable: no attempt is
spent, nothing goes dead, and the other messages flow.

Each object is named in ``<table>_payloads`` before it is written (``record``), and only
`relay prune` deletes it, once the row it was stored for has left history
(:class:`StoredPayloads`, relay.retention): never while a replay could need it, and no
object is left that prune cannot find, whenever a relay is killed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from relay.contract import (
    CHECK_TIMEOUT_S,
    DestinationCheck,
    DestinationState,
    Outcome,
    Publisher,
    publish_within,
)
from relay.errors import ConfigError, DestinationUnavailable, first_line
from relay.message import OutboxMessage

log = logging.getLogger("relay.claimcheck")

# A message whose payload could not be stored waits this long before it is claimed again.
STORE_RETRY = timedelta(seconds=5)
# Uploads at once per publish (each a thread of boto3's blocking client).
UPLOADS_AT_ONCE = 8


# Names the objects about to be stored, ``record(refs, outbox_ids)``, before they are
# written (relay.db.dispatch.OutboxStore.record_payloads).
Record = Callable[[Sequence[str], Sequence[int]], Awaitable[None]]


@dataclass(frozen=True)
class ClaimCheckSettings:
    """Where large payloads go, and from what size."""

    bucket: str
    threshold: int  # payload bytes; larger ones are stored
    prefix: str = "outbox-relay/"
    endpoint_url: str | None = None
    region: str | None = None

    def key(self, m: OutboxMessage) -> str:
        return f"{self.prefix}{m.event_id or m.id}"

    def url(self, m: OutboxMessage) -> str:
        return f"s3://{self.bucket}/{self.key(m)}"


def digest_text(sha256: bytes) -> str:
    """A ``datadigest``: ``sha-256=`` and the base64 of the SHA-256 ``sha256``."""
    return "sha-256=" + base64.b64encode(sha256).decode()


def digest(body: bytes) -> str:
    """The ``datadigest`` of ``body``."""
    return digest_text(hashlib.sha256(body).digest())


def reference(settings: ClaimCheckSettings, m: OutboxMessage, sums: str) -> OutboxMessage:
    """``m`` as it is sent once its payload is stored (its ``datadigest`` ``sums``): a JSON
    reference as the body, and ``dataref`` and ``datadigest`` among its headers."""
    ref = settings.url(m)
    body = json.dumps({"dataref": ref, "datadigest": sums, "size": m.body_size}).encode()
    return replace(m, body=body, headers={**(m.headers or {}), "dataref": ref, "datadigest": sums}, spooled=None)


@dataclass(frozen=True)
class ClaimChecks:
    """Which claim-check settings, if any, each event type's messages go by: the relay's
    own (``default``, None when it has no bucket) or its route's (``[[routes]]`` tables may
    set their own bucket, threshold and prefix, or ``claim_check = false``), chosen as the
    routes choose a destination (``route_of``: a route's index, or -1 for none)."""

    default: ClaimCheckSettings | None
    routes: tuple[ClaimCheckSettings | None, ...] = ()
    route_of: Callable[[str], int | None] | None = None

    def of(self, event_type: str) -> ClaimCheckSettings | None:
        chosen = self.route_of(event_type) if self.route_of is not None and self.routes else None
        return self.routes[chosen] if chosen is not None and chosen >= 0 else self.default

    def stores(self, event_type: str, size: int) -> bool:
        """Whether a payload of ``size`` bytes of ``event_type`` goes to the store."""
        settings = self.of(event_type)
        return settings is not None and size > settings.threshold

    @property
    def each(self) -> tuple[ClaimCheckSettings, ...]:
        """Every distinct bucket's settings, the relay's own first."""
        found: dict[str, ClaimCheckSettings] = {}
        for settings in (self.default, *self.routes):
            if settings is not None:
                found.setdefault(settings.bucket, settings)
        return tuple(found.values())

    @property
    def smallest_threshold(self) -> int:
        return min(s.threshold for s in (self.default, *self.routes) if s is not None)

    @property
    def endpoint_url(self) -> str | None:
        return self.each[0].endpoint_url

    @property
    def region(self) -> str | None:
        return self.each[0].region


def where(settings: ClaimCheckSettings) -> str:
    return f"claim-check bucket s3://{settings.bucket}"


class ClaimCheckStore:
    """The object store of one relay process (boto3's S3 client, its calls in threads),
    for the buckets ``checks`` names (one endpoint and region for them all)."""

    def __init__(self, checks: ClaimChecks, client: Any | None = None) -> None:
        self.checks = checks
        self._client = client
        self._turns = asyncio.Semaphore(UPLOADS_AT_ONCE)
        self._failing: dict[str, str] = {}  # bucket: why it refuses payloads, while it does

    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.checks.endpoint_url, self.checks.region)
        return self._client

    async def check_destinations(self) -> list[DestinationCheck]:
        """Each bucket as a destination of its own (relay.contract.ChecksDestinations): a
        missing bucket or a store that does not answer holds the messages that need it, and
        shows in /readyz and the start-up lines as a missing exchange or queue does."""
        return [await self._look(settings) for settings in self.checks.each]

    async def _look(self, settings: ClaimCheckSettings) -> DestinationCheck:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                await asyncio.to_thread(self.client().head_bucket, Bucket=settings.bucket)
        except ConfigError as exc:  # boto3 not installed: nothing can be stored
            return DestinationCheck(where(settings), DestinationState.UNREACHABLE, str(exc))
        except TimeoutError:
            return DestinationCheck(where(settings), DestinationState.UNREACHABLE, f"no answer in {CHECK_TIMEOUT_S:g}s")
        except Exception as exc:
            return DestinationCheck(where(settings), _state(exc), _why(exc))
        return DestinationCheck(where(settings), DestinationState.EXISTS)

    async def publish(
        self, publisher: Publisher, batch: Sequence[OutboxMessage], deadline_s: float, record: Record
    ) -> list[Outcome]:
        """Store the payloads of ``batch`` over their threshold (each named by ``record``
        first), then publish it through ``publisher`` with references in their place; a
        message whose payload could not be recorded or stored is not published, its outcome
        saying why (attempt refunded)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline_s
        chosen = [self.checks.of(m.event_type) for m in batch]
        large = [
            i for i, (m, c) in enumerate(zip(batch, chosen, strict=True)) if c is not None and m.body_size > c.threshold
        ]
        # A payload read into a file is one the store takes; were it not (a bug), it is read
        # back into the body here rather than sent empty.
        going_to_store = set(large)
        batch = [_unspooled(m) if m.spooled is not None and i not in going_to_store else m for i, m in enumerate(batch)]
        outcomes: list[Outcome] = [None] * len(batch)
        sent = list(batch)
        if large:
            pairs = [(batch[i], _settings(chosen[i])) for i in large]
            try:
                async with asyncio.timeout_at(until):
                    await self._record(record, pairs)
                    stored = await asyncio.gather(*(self._store(m, c) for m, c in pairs), return_exceptions=True)
            except TimeoutError:
                stored = [TimeoutError("storing the payload took the whole publish deadline")] * len(large)
            except Exception as exc:  # the database refused the record: nothing was stored
                stored = [_Unrecorded(f"the objects could not be recorded in the outbox's database: {first_line(exc)}")]
                stored *= len(large)
            for i, result in zip(large, stored, strict=True):
                settings = _settings(chosen[i])
                if isinstance(result, BaseException):
                    outcomes[i] = self._unavailable(result, settings)
                else:
                    sent[i] = reference(settings, batch[i], result)
        going = [i for i in range(len(batch)) if outcomes[i] is None]
        if going:
            left = max(until - loop.time(), 0.001)
            published = await publish_within(publisher, [sent[i] for i in going], left)
            for i, outcome in zip(going, published, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _record(self, record: Record, pairs: Sequence[tuple[OutboxMessage, ClaimCheckSettings]]) -> None:
        # One row per object: messages of one event id share it (the latest row keeps it).
        latest: dict[str, int] = {}
        for m, settings in pairs:
            ref = settings.url(m)
            latest[ref] = max(latest.get(ref, m.id), m.id)
        await record(list(latest), list(latest.values()))

    async def _store(self, m: OutboxMessage, settings: ClaimCheckSettings) -> str:
        """Store ``m``'s payload; its ``datadigest`` (hashed once: a payload may be 100 MB,
        and a spooled one was hashed as it was read)."""
        spooled = m.spooled
        sums = digest(m.body) if spooled is None else digest_text(spooled.sha256)
        async with self._turns:
            if spooled is not None:
                spooled.file.seek(0)  # read again by a retry of the same batch (isolation)
            await asyncio.to_thread(
                self.client().put_object,
                Bucket=settings.bucket,
                Key=settings.key(m),
                Body=m.body if spooled is None else spooled.file,
                ContentLength=m.body_size,
                ContentType="application/json",
                Metadata={"datadigest": sums, "event-type": m.event_type[:256]},
            )
        if self._failing.pop(settings.bucket, None) is not None:
            log.info("%s takes payloads again", where(settings))
        return sums

    def _unavailable(self, exc: BaseException, settings: ClaimCheckSettings) -> DestinationUnavailable:
        why = _why(exc)
        if self._failing.get(settings.bucket) != why:
            log.warning("%s refuses payloads; their messages wait (no attempt spent): %s", where(settings), why)
            self._failing[settings.bucket] = why
        return DestinationUnavailable(
            f"the payload could not be stored in {where(settings)}: {why}",
            destination=where(settings),
            retry_after=STORE_RETRY,
        )


def _unspooled(m: OutboxMessage) -> OutboxMessage:
    assert m.spooled is not None
    m.spooled.file.seek(0)
    return replace(m, body=m.spooled.file.read(), spooled=None)


def _settings(chosen: ClaimCheckSettings | None) -> ClaimCheckSettings:
    assert chosen is not None  # only messages with settings are large
    return chosen


class _Unrecorded(Exception):
    """The objects could not be named in ``<table>_payloads``, so none was stored."""


def s3_client(endpoint_url: str | None, region: str | None) -> Any:
    """boto3's S3 client for the claim-check's store (AWS S3 unless ``endpoint_url``)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError(
            "the claim-check needs boto3, which is not installed: pip install 'outbox-relay[sqs]'"
        ) from None
    config = Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"})
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


# Keys one DeleteObjects request takes (S3's limit).
DELETE_AT_ONCE = 1000


class StoredPayloads:
    """What `relay prune` deletes stored objects with (those whose rows left history): the
    store at ``endpoint_url`` (AWS S3 if None), each object's bucket taken from its reference."""

    def __init__(self, endpoint_url: str | None = None, region: str | None = None, client: Any | None = None) -> None:
        self.endpoint_url = endpoint_url
        self.region = region
        self._client = client

    async def delete(self, refs: Sequence[str]) -> tuple[list[str], str | None]:
        """Delete the objects ``refs`` (``s3://bucket/key``; a missing one counts as
        deleted); returns those deleted and, if any was not, why (one line)."""
        return await asyncio.to_thread(self._delete, refs)

    def _delete(self, refs: Sequence[str]) -> tuple[list[str], str | None]:
        by_bucket: dict[str, list[str]] = {}
        for ref in refs:
            bucket, _, key = ref.removeprefix("s3://").partition("/")
            by_bucket.setdefault(bucket, []).append(key)
        deleted: list[str] = []
        why = None
        try:
            if self._client is None:
                self._client = s3_client(self.endpoint_url, self.region)
            for bucket, keys in by_bucket.items():
                for at in range(0, len(keys), DELETE_AT_ONCE):
                    some = keys[at : at + DELETE_AT_ONCE]
                    answer = self._client.delete_objects(
                        Bucket=bucket, Delete={"Objects": [{"Key": k} for k in some], "Quiet": True}
                    )
                    failed = {e.get("Key"): e for e in answer.get("Errors", [])}
                    deleted += [f"s3://{bucket}/{k}" for k in some if k not in failed]
                    if failed and why is None:
                        e = next(iter(failed.values()))
                        why = f"{e.get('Code', 'Error')}: {e.get('Message', '')}".strip(": ")
        except Exception as exc:  # unreachable, no credentials, no bucket: the rest waits
            why = _why(exc)
        return deleted, why


def _state(exc: BaseException) -> DestinationState:
    """What HeadBucket's failure says of the bucket: missing (404), access denied (403), or
    a store that did not answer."""
    response = getattr(exc, "response", None)
    code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    if code in ("404", "NoSuchBucket", "NotFound"):
        return DestinationState.MISSING
    if code in ("403", "AccessDenied", "Forbidden"):
        return DestinationState.DENIED
    return DestinationState.UNREACHABLE


def _why(exc: BaseException) -> str:
    """One line for a store failure: the S3 error code where there is one."""
    if isinstance(exc, _Unrecorded):
        return str(exc)
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        code, message = error.get("Code"), error.get("Message")
        if code:
            return f"{code}: {message}" if message else str(code)
    return f"{type(exc).__name__}: {first_line(exc)}"


# The consumer's side: what relay.Consumer fetches a claim-checked payload with.

# Bytes read from the store at a time: a payload of any size passes in this much memory.
FETCH_CHUNK = 1024 * 1024


class PayloadFetcher:
    """Fetches claim-checked payloads for a consumer (relay.Consumer ``claim_check=``): the
    object ``dataref`` names, streamed into a temporary file in ``directory`` while its
    SHA-256 is computed, and refused unless that matches ``datadigest``.

    :param client: a boto3 S3 client (``boto3.client("s3", endpoint_url=...)``); its calls
        run in threads.
    """

    def __init__(self, client: Any, directory: str | None = None) -> None:
        self.client = client
        self.directory = directory

    async def fetch(self, dataref: str, datadigest: str) -> Path:
        """The payload's file (the caller removes it). ``ValueError`` for a reference the
        relay did not write or a digest that does not match (the object was changed)."""
        return await asyncio.to_thread(self._fetch, dataref, datadigest)

    def _fetch(self, dataref: str, datadigest: str) -> Path:
        if not dataref.startswith("s3://") or "/" not in dataref[5:]:
            raise ValueError(f"dataref {dataref[:200]!r} is not an s3:// reference")
        if not datadigest.startswith("sha-256="):
            raise ValueError("datadigest is not a sha-256 digest")
        bucket, key = dataref[5:].split("/", 1)
        body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
        sha = hashlib.sha256()
        handle = tempfile.NamedTemporaryFile(prefix="relay-payload-", dir=self.directory, delete=False)  # noqa: SIM115
        path = Path(handle.name)
        try:
            with handle, contextlib.closing(body):
                while chunk := body.read(FETCH_CHUNK):
                    sha.update(chunk)
                    handle.write(chunk)
            if digest_text(sha.digest()) != datadigest:
                raise ValueError(f"the payload at {dataref} does not match its datadigest: it was changed")
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path
