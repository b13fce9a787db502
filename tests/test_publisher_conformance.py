"""One contract, every adapter: the publisher conformance suite (relay.testing.conformance)
run against each built-in destination for real (RabbitMQ, SQS and SNS standard and FIFO on
moto in server mode, HTTP, Kafka, NATS JetStream) and against the in-memory and log
publishers, through the harnesses of tests/publisher_targets.py.

Each case runs once per entry of ``TARGETS``; a destination that cannot take part in a
case declares why, and the case skips with that reason (a skip is not a pass:
``test_every_case_runs_on_at_least_two_real_brokers`` keeps each case on two real brokers
at least). The adapters' own suites test every failure class one by one.
"""

from __future__ import annotations

import pytest

from relay.testing.conformance import CASES, Harness, PublisherConformance
from tests.publisher_targets import TARGETS, TargetSpec


class TestEveryDestination(PublisherConformance):
    @pytest.fixture(params=TARGETS, ids=[spec.name for spec in TARGETS])
    def harness(self, request: pytest.FixtureRequest) -> Harness:
        """The harness, built from the fixtures it names (only those: memory and log need
        no broker). Synchronous, because an async fixture cannot request fixtures lazily."""
        spec: TargetSpec = request.param
        return spec.build({name: request.getfixturevalue(name) for name in spec.kind.FIXTURES})


def test_every_case_runs_on_at_least_two_real_brokers() -> None:
    """Skips are declared, with a reason, by the harness; none may leave a case covered by
    fewer than two real brokers, and a harness refuses messages exactly when it says it can."""
    for case in CASES:
        real = [spec.name for spec in TARGETS if spec.kind.REAL_BROKER and case not in spec.kind.UNSUPPORTED]
        assert len(real) >= 2, f"{case} runs on real brokers {real} only"
    for spec in TARGETS:
        assert bool(spec.kind.REFUSALS) == ("permanent_failure" not in spec.kind.UNSUPPORTED), spec.name
        assert all(reason.strip() for reason in spec.kind.UNSUPPORTED.values()), spec.name
        assert set(spec.kind.UNSUPPORTED) <= set(CASES), spec.name
