"""``llamarl.dashboard``: the Streamlit + plotly app over a run directory.

Reads ``runs/<run-id>/metrics.db`` only and never talks to a running app. May import
``llamarl.app.names`` and ``llamarl.app.metrics`` (the metric names and the database
schema), nothing else of llamarl.
"""
