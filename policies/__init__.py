"""Snapshot policies: pure decisions over measured costs and step counts (no Ray, no I/O).

- ``costs``: the measured costs (``MeasuredCosts``) and ``InfeasibleError``.
- ``models``: Young, Daly, CheckFreq-style and shadow-snapshot intervals; closed-form expected waste
  of each strategy; the model-optimal interval.
- ``simulate``: seeded discrete-event Monte Carlo of long runs with failures.
- ``compare``: every strategy at classical and optimal intervals, and the recommendation.
- ``replan``: robust online estimates and a re-planner with hysteresis.
- ``interval``: ``snapshot_due``, the one rule for "is a snapshot due" (steps since the last snapshot
  reach the interval in force), ``SnapshotSchedule`` (that rule for the shadow and the worker
  checkpointers) and ``AdaptiveInterval`` (what the controller's planner, ``orchestrator.planning``,
  feeds with measurements; it pushes each re-planned interval to the shadow).
- ``layerwise``: LayerCheck's choice of which units to persist (change threshold, staleness bound,
  byte budget per step).
"""
