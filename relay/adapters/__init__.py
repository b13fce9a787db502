"""Broker adapters for outbox-relay. Each implements :class:`relay.contract.Publisher`;
:mod:`adapters.registry` finds them by broker name."""
