"""The operator tools (`relay status`, `explain`, `dead`, `release`; `prune` is
:mod:`relay.retention`, which the running relay uses too) as logic over the database
layer's rows.

:mod:`relay.db` (readmodel, actions, history) runs the statements and returns frozen
dataclasses; :mod:`~relay.ops.status`, :mod:`~relay.ops.explain`,
:mod:`~relay.ops.deadletters` and :mod:`~relay.ops.release` hold the logic over those
objects; :mod:`relay.ops.render` turns the results into text and JSON. The command line
(:mod:`relay.cli`) and the console sit on top; nothing the running relay needs lives here.
"""
