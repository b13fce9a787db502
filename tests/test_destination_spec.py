"""DestinationSpec: what each destination declares, checked where it is written, and the
one create() that builds every destination's publisher; the registry's view of the
built-in specs. No service needed."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from relay import ConfigError, DestinationSpec, OutboxMessage, Outcome, PublishLimits
from relay.adapters import registry

ROOT = Path(__file__).resolve().parent.parent
LIMITS = PublishLimits(publish_timeout=timedelta(seconds=20), workers=4, batch_size=100)


@dataclass(frozen=True)
class EchoSettings:
    url: str
    workers: int

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> EchoSettings:
        if not values.get("url"):
            raise ConfigError("no url")
        return cls(values["url"], limits.workers)


class EchoPublisher:
    name = "echo"

    def __init__(self, settings: EchoSettings) -> None:
        self.settings = settings

    async def start(self) -> None:
        pass

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        return [None] * len(batch)

    async def close(self) -> None:
        pass


def needs_an_sdk(settings: EchoSettings) -> EchoPublisher:
    """A publisher factory whose SDK this machine does not have."""
    import no_such_sdk.client  # type: ignore[import-not-found]  # noqa: F401

    return EchoPublisher(settings)


def test_create_builds_the_settings_from_values_or_takes_them_built() -> None:
    spec = DestinationSpec(name="echo", settings=EchoSettings, publisher=EchoPublisher)
    from_values = spec.create({"url": "echo://a"}, LIMITS)
    assert isinstance(from_values, EchoPublisher) and from_values.settings == EchoSettings("echo://a", 4)
    built = EchoSettings("echo://b", 1)
    assert spec.create(built, LIMITS).settings is built  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="no url"):
        spec.create({}, LIMITS)


def test_a_publisher_named_as_module_and_attribute_is_imported_when_built() -> None:
    spec = DestinationSpec(name="echo", settings=EchoSettings, publisher=f"{__name__}:EchoPublisher")
    assert isinstance(spec.create({"url": "x"}, LIMITS), EchoPublisher)


def test_a_missing_sdk_is_one_line_naming_what_to_install() -> None:
    spec = DestinationSpec(
        name="needy",
        settings=EchoSettings,
        publisher=f"{__name__}:needs_an_sdk",
        sdk_modules=("no_such_sdk",),
        extra="needy-destination[sdk]",
    )
    with pytest.raises(ConfigError) as raised:
        spec.create({"url": "x"}, LIMITS)
    assert str(raised.value) == (
        "--broker needy needs no_such_sdk, which is not installed: pip install 'needy-destination[sdk]'"
    )
    # A module the spec does not name as its SDK is a bug of the adapter, raised as it is.
    other = DestinationSpec(name="needy", settings=EchoSettings, publisher=f"{__name__}:needs_an_sdk")
    with pytest.raises(ModuleNotFoundError):
        other.create({"url": "x"}, LIMITS)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"name": "Redis"}, "use lowercase letters, digits and single dashes"),
        ({"name": "redis--streams"}, "use lowercase letters, digits and single dashes"),
        ({"publisher": "relay_redis_streams.publisher.Publisher"}, "is not 'module:attribute'"),
        ({"sdk_modules": ("redis",)}, "need the extra that installs them"),
        ({"max_envelope_fields": 0}, "must be at least 1"),
    ],
)
def test_a_wrong_spec_fails_where_it_is_written(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        DestinationSpec(**{"name": "echo", "settings": EchoSettings, "publisher": EchoPublisher, **fields})


def test_every_built_in_destination_declares_its_spec_as_the_registry_names_it() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # The suite runs without installed destinations (tests/conftest.py).
    assert registry.BROKERS == registry.BUILT_IN
    specs = registry.specs()
    assert list(specs) == list(registry.BUILT_IN)
    for name, spec in specs.items():
        assert spec.name == name
        assert all(o.section == name or name in o.also_in for o in spec.options), name
        if spec.sdk_modules:
            package, _, extra = spec.extra.partition("[")
            assert package == "outbox-relay" and extra.rstrip("]") in extras, spec.extra
    assert registry.max_envelope_fields("sqs") == registry.max_envelope_fields("sns") == 12
    assert {n for n in registry.BUILT_IN if registry.max_envelope_fields(n) is None} == {
        "rabbitmq",
        "http",
        "kafka",
        "nats",
        "log",
    }


def test_a_name_no_destination_has_is_one_config_error_line() -> None:
    with pytest.raises(ConfigError, match="no destination is named 'carrier-pigeon': choose from sqs, sns"):
        registry.spec_of("carrier-pigeon")
