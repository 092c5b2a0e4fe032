"""labrl.harness.planning: how fast a layout trains and how stale its samples are, before it runs.

``model`` is the closed-form steady state, ``simulate`` the discrete-event simulation of the
pipeline, ``draws`` the distributions it samples, ``calibrate`` reads them from a run's
``episodes.jsonl`` (docs/planning.md).
"""
