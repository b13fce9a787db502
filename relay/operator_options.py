"""The operator commands' own options: `relay console`, `relay status`, `relay dead`,
`relay prune`, `relay release` and `relay settings set` (each also takes the outbox's and
the logging options, declared in :mod:`relay.config`).

Declared with the rest (:mod:`relay.options`), read the same way: flag, ``RELAY_*``
variable, config file, default. A setting of one command carries the command's name in
its variable and table (``relay console --port``: ``RELAY_CONSOLE_PORT``, ``[console]
port``), so that it says what it sets beside every other command's. What only one run of
a command means (which messages, --yes, --dry-run, --json) is command-line only
(``cli_only``); each such declaration says why.

This module imports no command and nothing of the operator tools, so that what reads
every declared variable (the warning about unknown ones) can import it.
"""

from __future__ import annotations

from dataclasses import replace

from relay.db.partitions import DEFAULT_AHEAD
from relay.options import DAY, HOUR, MINUTE, MS, SECOND, Option
from relay.replay import MAX_EXCLUDED
from relay.retention import DEFAULT_BATCH

# ---- what several commands share: how they answer, and the record an action leaves

# Command-line only: the shape of one answer. A standing --json in a variable would change
# the output of every later run, and break the eyes or the script that reads it.
JSON = Option("json", "bool", False, "Print JSON instead of text.", cli_only=True)
# Command-line only: a preview is asked for by the run that wants one; a standing one in a
# variable would make every real run change nothing, silently.
DRY_RUN = Option("dry_run", "bool", False, "Check and show what would change; change nothing.", cli_only=True)
# Command-line only: who acts is recorded with the messages; a name in a shared file or
# environment would record every operator under one name (the default, user@host, is each
# operator's own).
BY = Option(
    "by",
    "str",
    None,
    "Who is acting, recorded with the messages (default: user@host).",
    metavar="WHO",
    cli_only=True,
)
# Command-line only: why this action was taken, recorded with the messages it changed.
REASON = Option("reason", "str", None, "Why, recorded with the messages (optional).", metavar="TEXT", cli_only=True)

# ---- relay console

CONSOLE = "console"  # its table in the config file
DEFAULT_CONSOLE_PORT = 8465

CONSOLE_TOKENS = Option(
    "console_tokens",
    "list",
    (),
    "A token actions must carry (repeatable; also $RELAY_CONSOLE_TOKEN); NAME is who its actions are recorded as.",
    flag_name="--token",
    metavar="[NAME=]SECRET",
    secret=True,
    # Command-line only: the flags add tokens to the one RELAY_CONSOLE_TOKEN (or the file's
    # [console] token) holds, as they always did; a flag's value would otherwise replace it.
    cli_only=True,
)
CONSOLE_TOKEN = Option(
    "console_token",
    "str",
    None,
    "A token actions must carry, as --token takes it ([NAME=]SECRET), added to those of --token;"
    " only from the environment or the config file, never a flag in a process list.",
    section=CONSOLE,
    key="token",
    secret=True,
    env_only=True,
)

CONSOLE_OPTIONS: tuple[Option, ...] = (
    Option(
        "console_host",
        "str",
        "127.0.0.1",
        "Address to listen on (loopback by default).",
        section=CONSOLE,
        key="host",
        flag_name="--host",
    ),
    Option(
        "console_port",
        "int",
        DEFAULT_CONSOLE_PORT,
        "Port (0: any free port).",
        section=CONSOLE,
        key="port",
        flag_name="--port",
        minimum=0,
        maximum=65535,
        click_checked=True,
    ),
    Option(
        "console_allow_actions",
        "bool",
        False,
        "Let the page retry and skip dead messages; every action then needs a --token.",
        section=CONSOLE,
        key="allow_actions",
        flag_name="--allow-actions",
    ),
    CONSOLE_TOKENS,
    CONSOLE_TOKEN,
    Option(
        "console_by",
        "str",
        None,
        "Record every action as WHO instead of the token's name.",
        section=CONSOLE,
        key="by",
        flag_name="--by",
        metavar="WHO",
    ),
    Option(
        "console_allow_hosts",
        "list",
        (),
        "A Host name the page answers to besides loopback ones and --host (repeatable): the name a proxy"
        " forwards. Other names are refused (DNS rebinding).",
        section=CONSOLE,
        key="allow_hosts",
        flag_name="--allow-host",
        param_name="allow_hosts",
        metavar="NAME",
    ),
    Option(
        "console_history",
        "duration",
        "1h",
        "How far back the overview's chart goes.",
        section=CONSOLE,
        key="history",
        flag_name="--history",
        # The chart keeps its samples in memory: under a minute shows nothing of a trend,
        # a day of samples at the shortest interval is what it is sized for.
        minimum=MINUTE,
        maximum=DAY,
    ),
    Option(
        "console_sample_interval",
        "duration",
        "5s",
        "How often the chart is sampled.",
        section=CONSOLE,
        key="sample_interval",
        flag_name="--sample-interval",
        # Each sample is a query on the outbox: more often than a second is load for nothing;
        # past ten minutes the chart has too few points to show one.
        minimum=SECOND,
        maximum=10 * MINUTE,
    ),
)

# ---- relay status

STATUS_OPTIONS: tuple[Option, ...] = (
    replace(JSON, help="One JSON object (with --watch: one per refresh)."),
    Option(
        "status_by_event_type",
        "bool",
        False,
        "Break the unfinished messages down by event type.",
        flag_name="--by-event-type",
        # Command-line only: the shape of one answer, as --json.
        cli_only=True,
    ),
    Option(
        "status_watch",
        "bool",
        False,
        "Redraw in place every --interval until Ctrl-C.",
        flag_name="--watch",
        # Command-line only: a standing one would turn every script's `relay status` into a
        # loop that never ends.
        cli_only=True,
    ),
    Option(
        "status_interval",
        "duration",
        "2s",
        "Refresh period of --watch.",
        section="status",
        key="interval",
        flag_name="--interval",
        # Faster than 100 ms is a busy loop on the database; slower than an hour is not watching.
        minimum=100 * MS,
        maximum=HOUR,
    ),
)

# ---- relay dead list|retry|skip

# `relay dead list` prints at most this many rows: a table that long is read with --json.
DEAD_LIST_MAX = 1_000_000
# Groups on a page of `relay dead list --group` (relay.ops.deadletters.GROUPS_PER_PAGE, which
# this module does not import: tests/test_cli_options.py holds them equal).
DEAD_GROUPS_PER_PAGE = 50

# Command-line only, all of them: a filter picks the messages one command acts on; one
# standing in a variable or a shared file would make `relay dead retry` re-drive messages
# nobody named. Their dests keep the names relay.cli.dead reads them by (f_...).
DEAD_FILTER_OPTIONS: tuple[Option, ...] = (
    Option(
        "f_event_types",
        "list",
        (),
        "Only this event type (repeatable).",
        flag_name="--event-type",
        metavar="TYPE",
        cli_only=True,
    ),
    Option("f_aggregate", "str", None, "Only this aggregate id.", flag_name="--aggregate", metavar="ID", cli_only=True),
    Option(
        "f_error",
        "str",
        None,
        "Only those whose last error contains TEXT.",
        flag_name="--error",
        metavar="TEXT",
        cli_only=True,
    ),
    Option(
        "f_newer",
        "str",
        None,
        "Only messages created after WHEN: a duration ago (2h) or an ISO time (local unless offset given).",
        flag_name="--newer-than",
        metavar="WHEN",
        cli_only=True,
    ),
    Option(
        "f_older",
        "str",
        None,
        "Only messages created before WHEN.",
        flag_name="--older-than",
        metavar="WHEN",
        cli_only=True,
    ),
)

DEAD_LIST_OPTIONS: tuple[Option, ...] = (
    Option(
        "dead_grouped",
        "bool",
        False,
        "Group by error fingerprint, with counts.",
        flag_name="--group",
        # Command-line only: the shape of one answer, as --json.
        cli_only=True,
    ),
    Option(
        "dead_limit",
        "int",
        100,
        "Rows to show.",
        section="dead",
        key="limit",
        flag_name="--limit",
        minimum=1,
        maximum=DEAD_LIST_MAX,
        click_checked=True,
    ),
    Option(
        "dead_page",
        "int",
        1,
        f"With --group: which page of {DEAD_GROUPS_PER_PAGE} groups, largest first.",
        flag_name="--page",
        minimum=1,
        maximum=1_000_000,
        click_checked=True,
        # Command-line only: where one reading is; a standing page would hide the first ones.
        cli_only=True,
    ),
    replace(JSON, help="Print JSON instead of a table."),
)

# What `relay dead retry` and `relay dead skip` act on, beside ids and the filters. Both
# command-line only: a standing group or --all would act on messages nobody named.
DEAD_SELECT_OPTIONS: tuple[Option, ...] = (
    Option(
        "dead_group",
        "str",
        None,
        "The dead messages of one error group (`relay dead list --group`).",
        flag_name="--group",
        metavar="KEY",
        cli_only=True,
    ),
    Option("dead_all", "bool", False, "Every dead message.", flag_name="--all", cli_only=True),
)

# ---- relay prune

PRUNE_OPTIONS: tuple[Option, ...] = (
    Option(
        "prune_cutoff",
        "duration",
        None,
        "Delete done rows finished longer ago than this (e.g. 7d). Required.",
        flag_name="--older-than",
        # 0 is allowed: every done row goes.
        minimum=0,
        maximum=36500 * DAY,
        # Command-line only: a one-off delete says its age itself, so that no variable or
        # file deletes rows on its own (the scheduled prune has --prune-older-than).
        cli_only=True,
    ),
    Option(
        "prune_include_dead",
        "bool",
        False,
        "Also delete dead unordered rows created before the cutoff. Dead ordered rows are kept"
        " (each stops its aggregate): they are counted and their aggregates named.",
        flag_name="--include-dead",
        # Command-line only: it deletes what would otherwise be kept; only the run that means
        # it may say so.
        cli_only=True,
    ),
    Option(
        "prune_skip_blocking",
        "bool",
        False,
        "With --include-dead: skip the dead ordered rows created before the cutoff, recorded as"
        " `relay dead skip` records them (needs --reason), which unblocks their aggregates.",
        flag_name="--skip-blocking",
        # Command-line only, as --include-dead: it finishes messages without delivery.
        cli_only=True,
    ),
    replace(REASON, help="Why --skip-blocking skips them (recorded)."),
    replace(BY, help="Who skips (recorded; default: user@host)."),
    Option(
        "prune_heads_cutoff",
        # Text, parsed by the command as a duration of at least 1h, so that a shorter one
        # keeps the words operators know ("invalid --heads-idle-for '5m': at least 1h").
        "str",
        None,
        "Also forget the aggregate_seq counter of every ordered aggregate with nothing unfinished that numbered"
        " nothing for this long (at least 1h, e.g. 90d): it starts again at 1 if it comes back. Off unless given.",
        flag_name="--heads-idle-for",
        metavar="DURATION",
        # Command-line only, as --older-than: a one-off forgetting says its age itself (the
        # scheduled prune has --prune-heads-idle-for).
        cli_only=True,
    ),
    Option(
        "prune_chunk_size",
        "int",
        DEFAULT_BATCH,
        "Ids per delete statement of `relay prune` (each its own short transaction).",
        section="prune",
        key="chunk_size",
        flag_name="--chunk-size",
        minimum=1,
        maximum=100_000,
        click_checked=True,
    ),
    replace(DRY_RUN, help="Count what would be deleted; delete nothing."),
    JSON,
)

# ---- relay release

# All command-line only: whose leases one run hands back (--owner, --ids), and its
# confirmation (--yes): a standing one would release leases nobody named, with no preview.
RELEASE_OWN_OPTIONS: tuple[Option, ...] = (
    Option(
        "release_owner",
        "str",
        None,
        "Lease owner (host:pid:worker), or a host or host:pid for all its workers.",
        flag_name="--owner",
        metavar="OWNER",
        cli_only=True,
    ),
    Option(
        "release_ids",
        "list",
        (),
        "Outbox ids (comma-separated, repeatable).",
        flag_name="--ids",
        metavar="1,2,3",
        cli_only=True,
    ),
    Option(
        "release_yes",
        "bool",
        False,
        "Release them; without it, only show what would be released.",
        flag_name="--yes",
        cli_only=True,
    ),
    BY,
    REASON,
    JSON,
)

# ---- relay settings set

# All command-line only: `relay settings set` changes only what its own flags name, so that
# nothing in an operator's environment or config file (RELAY_ORDERED, an [ordering] table,
# which `relay start` reads) changes the fleet by accident.
SETTINGS_SET_OPTIONS: tuple[Option, ...] = (
    Option(
        "settings_ordering_default",
        "choice",
        None,
        "Strategy for event types no rule names.",
        flag_name="--ordering-default",
        choices=("ordered", "unordered"),
        click_checked=True,
        cli_only=True,
    ),
    Option(
        "settings_ordered",
        "list",
        (),
        "The ordered list: event types or globs ('Order*'); repeatable; replaces the stored list ('' empties it).",
        flag_name="--ordered",
        metavar="TYPE",
        cli_only=True,
    ),
    Option(
        "settings_unordered",
        "list",
        (),
        "The unordered list, likewise.",
        flag_name="--unordered",
        metavar="TYPE",
        cli_only=True,
    ),
    Option(
        "settings_notify",
        "bool",
        None,
        "Whether producers' inserts NOTIFY the relays (off behind a transaction-mode pooler).",
        flag_name="--notify",
        cli_only=True,
    ),
    Option(
        "settings_commit_order",
        "choice",
        None,
        "How commit order is learned: 'stamp' (any producer; the default) or 'id' (every producer locks the"
        " aggregate before inserting: cheaper inserts). Run as the table's owner; see docs/concepts/ordering.md.",
        flag_name="--commit-order",
        choices=("stamp", "id"),
        click_checked=True,
        cli_only=True,
    ),
    JSON,
)


# ---- relay replay: what one replay publishes, and how (its broker and limits are
# relay start's options, relay.compose.REPLAY_OPTIONS). Command-line only, each: a
# selection, a run id or a destination in a shared file or variable would make every later
# replay publish the same history again, or to the same place, silently.

REPLAY_RUN_OPTIONS: tuple[Option, ...] = (
    Option("replay_from_id", "str", None, "Only messages with this id or above.", flag_name="--from-id",
           metavar="ID", cli_only=True),
    Option("replay_to_id", "str", None, "Only messages with this id or below.", flag_name="--to-id",
           metavar="ID", cli_only=True),
    Option("replay_since", "str", None, "Only messages created at or after WHEN: a duration ago (2h) or an ISO"
           " time (local unless offset given).", flag_name="--since", metavar="WHEN", cli_only=True),
    Option("replay_until", "str", None, "Only messages created before WHEN.", flag_name="--until",
           metavar="WHEN", cli_only=True),
    Option("replay_aggregates", "list", (), "Only this aggregate id (repeatable).", flag_name="--aggregate",
           param_name="aggregates", metavar="ID", cli_only=True),
    Option("replay_event_types", "list", (), "Only this event type or glob (repeatable).",
           flag_name="--event-type", param_name="event_types", metavar="TYPE", cli_only=True),
    Option("replay_include_dead", "bool", False, "Dead messages too (by default only delivered ones).",
           flag_name="--include-dead", cli_only=True),
    Option("replay_include_skipped", "bool", False, "Messages an operator skipped too (relay dead skip: never"
           " delivered, and left out by default).", flag_name="--include-skipped", cli_only=True),
    Option("replay_exclude", "list", (), f"Never replay these ids (comma-separated, repeatable; at most"
           f" {MAX_EXCLUDED:,}), whatever else selects them.", flag_name="--exclude", param_name="exclude_lists",
           metavar="1,2,3", cli_only=True),
    Option("replay_skip_failed", "bool", False, "Leave out a message that cannot be replayed and go on with the"
           " rest of its aggregate (by default its aggregate stops there, as a dead head stops it live).",
           flag_name="--skip-failed", cli_only=True),
    Option("replay_to", "str", None, "Send everything to this destination of the broker (a queue URL, topic ARN"
           " or exchange), ignoring routes.", flag_name="--to", param_name="to_destination", metavar="DESTINATION",
           cli_only=True),
    Option("replay_rate", "str", None, "Publish at most N messages per second (500, 500/s, 3000/m).",
           flag_name="--rate", metavar="N/s", cli_only=True),
    Option("replay_run_id", "str", None, "The `replay` header's value (default: the start time and a random"
           " suffix); a resumed replay keeps its own.", flag_name="--run-id", metavar="ID", cli_only=True),
    replace(DRY_RUN, help="Print what would be replayed; publish nothing."),
)  # fmt: skip


# ---- relay migrate: a partitioned outbox (relay.db.partitions, docs/partitioning.md)

MIGRATE_PARTITION_OPTIONS: tuple[Option, ...] = (
    Option(
        "partition_by",
        "choice",
        None,
        "Make the outbox range-partitioned by id or by created_at (time) (a new or empty one; a partitioned one"
        " stays so), so that relay prune drops finished partitions instead of deleting rows. By id needs"
        " --partition-size, by time --partition-interval.",
        choices=("id", "time"),
        click_checked=True,
        # Command-line only, as the options below: the table's shape is chosen by the one run
        # that creates it, never by a variable that every later `relay migrate` would read.
        cli_only=True,
    ),
    Option(
        "partition_size",
        "int",
        None,
        "With --partition-by id: ids per partition (e.g. 1000000, about a day of rows); fixed once chosen.",
        minimum=1,
        maximum=10**15,
        cli_only=True,
    ),
    Option(
        "partition_interval",
        "duration",
        None,
        "With --partition-by time: created_at span of each partition, a whole number of hours (1h, 1d, 7d),"
        " aligned to it from the epoch in UTC; fixed once chosen.",
        minimum=HOUR,
        maximum=366 * DAY,
        cli_only=True,
    ),
    Option(
        "partitions_ahead",
        "int",
        DEFAULT_AHEAD,
        "With --partition-by: partitions kept beyond the one the next id (by time: now) goes to.",
        minimum=1,
        maximum=1000,
        cli_only=True,
    ),
)


def _each_once(*options: Option) -> tuple[Option, ...]:
    """``options`` without a second declaration of a dest: the first stays (JSON, DRY_RUN, BY
    and REASON, listed first, rather than a command's rewording of their help)."""
    first: dict[str, Option] = {}
    for o in options:
        first.setdefault(o.dest, o)
    return tuple(first.values())


# Every option above, each once: what the config file's key check and the reference read
# beside the core's and the brokers'.
OPERATOR_OPTIONS: tuple[Option, ...] = _each_once(
    JSON,
    DRY_RUN,
    BY,
    REASON,
    *CONSOLE_OPTIONS,
    *STATUS_OPTIONS,
    *DEAD_FILTER_OPTIONS,
    *DEAD_LIST_OPTIONS,
    *DEAD_SELECT_OPTIONS,
    *PRUNE_OPTIONS,
    *REPLAY_RUN_OPTIONS,
    *RELEASE_OWN_OPTIONS,
    *SETTINGS_SET_OPTIONS,
    *MIGRATE_PARTITION_OPTIONS,
)
