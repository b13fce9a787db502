"""`relay console`: a web page for operators over the same reads and writes as the
operator commands (relay.ops): status, dead messages by error group, blocked aggregates,
one aggregate or message, and, only with ``--allow-actions`` and a token, re-drive or skip.

Layers: :mod:`relay.console.history` keeps the depth samples behind the overview's chart,
:mod:`relay.console.chart` draws them as SVG, :mod:`relay.console.auth` holds tokens,
sessions and the cross-site request forgery check, :mod:`relay.console.pages` gathers what
each page shows from relay.ops, and :mod:`relay.console.app` is the aiohttp application
that renders it with the Jinja2 templates beside it (autoescaped: producer data is text,
never markup).
"""
