"""`talaria tui`: a terminal dashboard of a node, live or played back from its event log.

`state` folds telemetry snapshots and event records into what the panels show (no Textual there);
`feed` reads them from a running node or an events file; `panels` draws them; `app` is the Textual
app that ties the three together. Panels, keys and sources: docs/tui.md.
"""
