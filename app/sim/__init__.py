"""The simulator of llamarl's loop: cost models (``costs``), a discrete-event replay of the
slot budget, staleness bound, stages and weight sync (``engine``), the models fitted from a
run's ``metrics.db`` (``calibrate``) or stated for a cluster on paper (``spec``), and
``python -m llamarl.app.sim``. Pure Python: no torch, no role is run (docs/simulator.md)."""
