"""The ``relay`` command line: :mod:`relay.cli.main` holds the group and the entry point."""
