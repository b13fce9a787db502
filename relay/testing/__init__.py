"""What tests need of the relay, for your own code and for a destination of your own.

* :class:`InMemoryPublisher`: a publisher that delivers into a list, each message's
  outcome scriptable (a failure class, or :data:`STALL` for a destination that never
  answers): for testing code around a publisher without a broker.
* :mod:`relay.testing.pytest_plugin`: pytest fixtures for a migrated outbox per test and a
  relay running beside it (``pytest_plugins = ["relay.testing.pytest_plugin"]`` in your
  top ``conftest.py``).
* :mod:`relay.testing.conformance`: the publisher conformance suite every built-in
  destination passes, to run against your own, and :func:`destination_spec` to build
  your publisher as the relay does, through its entry point.

Only tests import this package; the relay itself never does. The plugin and the suite
need pytest and pytest-asyncio (``pip install 'outbox-relay[testing]'``).
"""

from __future__ import annotations

from typing import Any

from relay.contract import DestinationSpec
from relay.testing.memory import STALL, InMemoryPublisher, Script

try:
    import pytest
except ImportError:  # InMemoryPublisher alone is usable without pytest
    pass
else:
    # The suite's asserts are rewritten as a test module's are, so that a failure shows its
    # values (pytest rewrites only modules it is told of before they are imported).
    pytest.register_assert_rewrite("relay.testing.conformance")

__all__ = ["STALL", "InMemoryPublisher", "Script", "destination_spec"]


def destination_spec(name: str) -> DestinationSpec[Any]:
    """The spec ``relay start --broker NAME`` uses: a built-in destination's, or that of
    an installed package, found through its entry point in ``outbox_relay.destinations``.
    Raises :class:`relay.ConfigError`, one line, for a name no destination has or one that
    cannot be loaded, as ``relay start`` would."""
    from relay.adapters.registry import spec_of

    return spec_of(name)
