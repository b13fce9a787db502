"""The operator tools (`relay status`, `explain`, `dead`, `prune`, `release`) in layers.

:mod:`relay.db.readmodel` runs the statements of ``sql/ops.sql`` and returns frozen
dataclasses; :mod:`~relay.ops.status`, :mod:`~relay.ops.explain`,
:mod:`~relay.ops.deadletters`, :mod:`~relay.ops.prune` and :mod:`~relay.ops.release` hold
the logic over those objects; :mod:`relay.ops.render` turns the results into text and
JSON. The command line (:mod:`relay.cli`) sits on top and nothing here imports it.
"""
