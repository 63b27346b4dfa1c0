"""Metric events and the run directory's metrics database.

``events``: the schema, the events every executor records and the SQLite writer on trainer
replica 0; ``tensorboard``: the same scalars as TensorBoard events (opt-in). May import
``names`` and ``errors`` only: the dashboard imports this package.
"""
