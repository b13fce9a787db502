"""The unit/integration split (tests/service_split.py), run on a small suite of its own:
a test is marked ``integration`` exactly when its fixtures reach a service, lazily
requested ones included, and a unit test that reaches one anyway fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """
import pytest

pytest_plugins = ("tests.service_split",)


@pytest.fixture
def pg_dsn():  # the name of a service fixture; nothing is started
    return "postgresql://nowhere/db"


@pytest.fixture
def names(pg_dsn):
    return "schema"


class Memory:
    FIXTURES = ("tmp_path",)


class Rabbit:
    FIXTURES = ("names",)


class Spec:  # a parameter whose kind names the fixtures (tests/publisher_targets.py)
    def __init__(self, kind):
        self.kind = kind


@pytest.fixture(params=[Spec(Memory), Spec(Rabbit)], ids=["memory", "rabbit"])
def harness(request):
    return {name: request.getfixturevalue(name) for name in request.param.kind.FIXTURES}


@pytest.fixture
def sneaky(request):  # a lazy request no parameter declares
    return request.getfixturevalue("pg_dsn")
"""

SAMPLE = """
def test_plain(tmp_path):
    pass


def test_direct(pg_dsn):
    pass


def test_through_a_fixture(names):
    pass


def test_lazy(harness):
    pass


def test_undeclared(sneaky):
    pass
"""

INI = """
[pytest]
addopts = --strict-markers
markers = integration: needs a service
asyncio_default_fixture_loop_scope = function
"""


def run_pytest(tmp_path: Path, *args: str) -> str:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
    (tmp_path / "pytest.ini").write_text(textwrap.dedent(INI))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.stdout + proc.stderr


def test_integration_is_every_test_whose_fixtures_reach_a_service(tmp_path: Path) -> None:
    out = run_pytest(tmp_path, "--collect-only", "-m", "integration")
    collected = sorted(line for line in out.splitlines() if line.startswith("test_sample.py::"))
    assert collected == [
        "test_sample.py::test_direct",
        "test_sample.py::test_lazy[rabbit]",
        "test_sample.py::test_through_a_fixture",
    ], out
    out = run_pytest(tmp_path, "--collect-only", "-m", "not integration")
    collected = sorted(line for line in out.splitlines() if line.startswith("test_sample.py::"))
    # test_undeclared's lazy request cannot be seen at collection: it is a unit test...
    assert collected == [
        "test_sample.py::test_lazy[memory]",
        "test_sample.py::test_plain",
        "test_sample.py::test_undeclared",
    ], out


def test_a_unit_test_that_reaches_a_service_fails(tmp_path: Path) -> None:
    # ...that fails once it has reached the service fixture; the others pass.
    out = run_pytest(tmp_path, "-rA")
    assert "ERROR at teardown of test_undeclared" in out, out
    assert "Failed: test_sample.py::test_undeclared was collected as a unit test but set up pg_dsn" in out, out
    assert "6 passed, 1 error" in out, out
