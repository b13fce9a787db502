"""Broker adapters for outbox-relay, and the publisher contract they implement."""

from adapters.base import Outcome, Publisher
from adapters.memory import STALL, InMemoryPublisher

__all__ = ["STALL", "InMemoryPublisher", "Outcome", "Publisher"]
