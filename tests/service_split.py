"""Unit and integration tests, told apart by what they need (a plugin, registered by
``pytest_plugins`` in tests/conftest.py).

A test whose fixture closure holds one of ``tests.services.SERVICE_FIXTURES`` needs a
service and is marked ``integration`` at collection; every other test is a unit test, which
`make test-unit` runs with no service at all. Nobody marks a test by hand, so a new test is
put on the right side by the fixtures it names. Fixtures a parametrized test requests
lazily (``request.getfixturevalue``) are not in its closure: a parameter that stands for
such fixtures names them in ``FIXTURES``, on itself or on its ``kind``
(tests/publisher_targets.py), and a test that reaches a service fixture without having
been marked fails, so the split cannot quietly go wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

from tests.services import SERVICE_FIXTURES

INTEGRATION = "integration"


def lazy_fixtures(item: pytest.Item) -> set[str]:
    """The fixtures ``item``'s parameters say they will request lazily."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    names: set[str] = set()
    for value in callspec.params.values():
        for holder in (value, getattr(value, "kind", None)):
            fixtures = getattr(holder, "FIXTURES", ())
            if isinstance(fixtures, tuple) and all(isinstance(name, str) for name in fixtures):
                names.update(fixtures)
    return names


def fixture_closure(item: pytest.Item, names: Iterable[str]) -> set[str]:
    """``names`` and every fixture they request in turn, as seen from ``item``."""
    # pytest's own closure walk is a method of its fixture manager, which it does not
    # export; FixtureManager.getfixturedefs and FixtureDef.argnames are what plugins use.
    manager = item.session._fixturemanager
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for fixturedef in manager.getfixturedefs(name, item) or ():
            todo.extend(fixturedef.argnames)
    return seen


def services_needed(item: pytest.Item) -> set[str]:
    """The service fixtures ``item`` needs, itself or through other fixtures."""
    closure = set(getattr(item, "fixturenames", ())) | fixture_closure(item, lazy_fixtures(item))
    return closure & SERVICE_FIXTURES


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if services_needed(item):
            item.add_marker(INTEGRATION)


@pytest.fixture(autouse=True)
def _unit_tests_reach_no_service(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test collected as a unit test that set up a service fixture anyway, checked
    once the test has run, when every fixture it asked for, lazily or not, is set up."""
    yield
    if request.node.get_closest_marker(INTEGRATION) is None:
        reached = SERVICE_FIXTURES.intersection(request.fixturenames)
        if reached:
            pytest.fail(
                f"{request.node.nodeid} was collected as a unit test but set up {', '.join(sorted(reached))}: "
                "name what it needs as its fixtures, or in FIXTURES on the parameter that requests them"
            )
