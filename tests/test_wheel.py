"""The wheel as users install it: one top-level package, `relay` (the adapters inside it),
typed, and per-broker extras: with only `outbox-relay[rabbitmq]` installed, `relay start
--broker rabbitmq` runs, and `--broker sqs` says which extra to install, in one line."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    [built] = out.glob("outbox_relay-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package_typed(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"relay"}, sorted(top)
    assert "relay/py.typed" in names
    assert "relay/adapters/rabbitmq/publisher.py" in names
    assert "relay/_sql/queries.sql" in names and "relay/_sql/inbox.sql" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    assert not any("boto3" in r or "aio-pika" in r for r in base), base
    for extra in ("rabbitmq", "sqs", "sns", "all"):
        assert f"Provides-Extra: {extra}" in metadata


@pytest.mark.extended
def test_a_venv_with_only_the_rabbitmq_extra(wheel: Path, tmp_path: Path, pg_dsn: str) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"outbox-relay[rabbitmq] @ {wheel.as_uri()}"],
        check=True,
        capture_output=True,
        text=True,
    )
    relay = env_dir / "bin" / "relay"
    have = subprocess.run([str(python), "-c", "import aio_pika, importlib.util as u; print(u.find_spec('boto3'))"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert have.stdout.strip() == "None"
    sqs = subprocess.run(
        [str(relay), "start", "--dsn", pg_dsn, "--broker", "sqs", "--queue-url", "https://sqs.eu-west-1.amazonaws.com/1/q"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sqs.returncode == 2, sqs.stderr
    lines = sqs.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'outbox-relay[sqs]'" in lines[0], sqs.stderr
    help_text = subprocess.run([str(relay), "start", "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--amqp-url" in help_text.stdout
