"""The settings every relay of one outbox shares, as ``<table>_settings`` holds them: read,
and changed under the settings row's lock (what each setting means, and who may change
it: :mod:`relay.shared_settings`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import sql
from psycopg.rows import dict_row

from relay.db.commit_order import CommitOrder, switch
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.statements import statement
from relay.errors import ConfigError
from relay.ordering import OrderingMap

SETTING_NAMES = ("ordering_default", "ordered", "unordered", "notify", "commit_order")


@dataclass(frozen=True)
class SharedSettings:
    """What ``<table>_settings`` holds (``updated_at`` by the database clock)."""

    ordering: OrderingMap
    notify: bool
    updated_at: datetime | None = None
    commit_order: CommitOrder = "stamp"

    def value(self, setting: str) -> Any:
        """One setting in the form its option takes: 'ordered'/'unordered', a tuple, a bool."""
        if setting == "ordering_default":
            return "ordered" if self.ordering.default_ordered else "unordered"
        if setting == "ordered":
            return self.ordering.ordered
        if setting == "unordered":
            return self.ordering.unordered
        if setting == "notify":
            return self.notify
        if setting == "commit_order":
            return self.commit_order
        raise KeyError(setting)

    def to_json(self) -> dict[str, Any]:
        return {
            "ordering": {
                "default": self.value("ordering_default"),
                "ordered": list(self.ordering.ordered),
                "unordered": list(self.ordering.unordered),
            },
            "notify": self.notify,
            "commit_order": self.commit_order,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
        }


@dataclass(frozen=True)
class SettingsUpdate:
    """What to change; a field left None keeps the stored value."""

    ordering_default: str | None = None  # 'ordered' or 'unordered'
    ordered: tuple[str, ...] | None = None
    unordered: tuple[str, ...] | None = None
    notify: bool | None = None
    commit_order: CommitOrder | None = None

    @classmethod
    def whole_map(cls, ordering: OrderingMap, *, notify: bool | None = None) -> SettingsUpdate:
        """Replace the whole ordering map (what `relay migrate --ordered ...` does)."""
        return cls(
            ordering_default="ordered" if ordering.default_ordered else "unordered",
            ordered=ordering.ordered,
            unordered=ordering.unordered,
            notify=notify,
        )

    def is_empty(self) -> bool:
        return all(getattr(self, s) is None for s in SETTING_NAMES)

    def apply(self, stored: SharedSettings) -> SharedSettings:
        """``stored`` with this update applied; ConfigError if the resulting map is invalid
        (a name in both lists, an empty entry)."""
        default = self.ordering_default if self.ordering_default is not None else stored.value("ordering_default")
        ordering = OrderingMap(
            default_ordered=default == "ordered",
            ordered=self.ordered if self.ordered is not None else stored.ordering.ordered,
            unordered=self.unordered if self.unordered is not None else stored.ordering.unordered,
        )
        return SharedSettings(
            ordering,
            self.notify if self.notify is not None else stored.notify,
            stored.updated_at,
            self.commit_order if self.commit_order is not None else stored.commit_order,
        )


@dataclass(frozen=True)
class Changed:
    """One setting that changed, as text for people."""

    setting: str
    old: str
    new: str


@dataclass(frozen=True)
class SettingsChange:
    """The settings before and after an update; ``changed`` is empty when it was a no-op."""

    before: SharedSettings
    after: SharedSettings
    changed: tuple[Changed, ...]


def show(setting: str, value: Any) -> str:
    """A setting's value as text: ``ordered``, ``['Order*', 'Paid']``, ``true``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return repr(list(value))
    return str(value)


def same(setting: str, a: Any, b: Any) -> bool:
    """Whether two values of ``setting`` mean the same."""
    # The lists are sets of rules: their order changes nothing about routing.
    if setting in ("ordered", "unordered"):
        return sorted(set(a)) == sorted(set(b))
    return bool(a == b)


def differences(before: SharedSettings, after: SharedSettings) -> tuple[Changed, ...]:
    return tuple(
        Changed(s, show(s, before.value(s)), show(s, after.value(s)))
        for s in SETTING_NAMES
        if not same(s, before.value(s), after.value(s))
    )


def _query(names: OutboxNames, name: str) -> sql.Composed:
    return statement(names, name)


def _from_row(row: Mapping[str, Any] | None, names: OutboxNames) -> SharedSettings:
    if row is None:
        raise ConfigError(f"{names.qualified}_settings has no row: run `relay migrate`")
    return SharedSettings(
        ordering=OrderingMap.from_sql_params(row),
        notify=bool(row["notify"]),
        updated_at=row["updated_at"],
        commit_order=row["commit_order"],
    )


async def read_settings(conn: Conn, names: OutboxNames) -> SharedSettings:
    """The stored settings of the outbox ``names``."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(_query(names, "settings_read"))
    return _from_row(await cur.fetchone(), names)


async def update_settings(conn: Conn, names: OutboxNames, update: SettingsUpdate) -> SettingsChange:
    """Apply ``update`` under the settings row's lock (so two operators cannot lose each
    other's change) and return what changed. Writes nothing when nothing changes."""
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(_query(names, "settings_lock"))
        before = _from_row(await cur.fetchone(), names)
        after = update.apply(before)
        changed = differences(before, after)
        if changed:
            await switch(conn, names, before.commit_order, after.commit_order)
            params = {**after.ordering.sql_params(), "notify": after.notify, "commit_order": after.commit_order}
            await cur.execute(_query(names, "settings_write"), params)
            row = await cur.fetchone()
            after = SharedSettings(after.ordering, after.notify, row["updated_at"] if row else None, after.commit_order)
    return SettingsChange(before, after, changed)


async def store_ordering(
    conn: Conn, names: OutboxNames, ordering: OrderingMap, *, notify: bool | None = None
) -> SettingsChange:
    """Store ``ordering`` whole (and ``notify``, when given)."""
    return await update_settings(conn, names, SettingsUpdate.whole_map(ordering, notify=notify))
