"""``python -m relay.cli``: the ``relay`` command, for checkouts without the console script."""

from relay.cli.main import main

main()
