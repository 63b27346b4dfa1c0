"""The run page's "What if" tab: the simulator (``llamarl.app.sim``) calibrated on the run
shown, its prediction of the run itself next to what the run measured, and of the same run
with one more generator or another staleness bound. Pure Python like the rest of the page:
the simulator imports no torch and reads the run's ``metrics.db`` read-only."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from llamarl.app.sim import calibrate, engine
from llamarl.dashboard import data


def table(run: data.Run) -> tuple[pd.DataFrame | None, str]:
    """The rows of the tab (measured first, then each predicted case) and a caption; no
    rows, and why, when the run has too little to fit the cost models on."""
    try:
        fit = calibrate.from_run(run.path)
        measured = calibrate.measured(run.path)
        loop = fit.loop()  # refuses a configuration the simulator cannot take
    except (OSError, ValueError) as err:
        return None, f"The simulator cannot fit this run (yet): {err}"
    if len(measured.step_s) < 2:
        return None, "Not enough recorded to fit the simulator yet: fewer than two steps."
    rows = [_row("measured", measured)] + [_row(f"predicted: {label}", r) for label, r in engine.what_if(loop)]
    caption = (f"Cost models fitted from this run's metrics (python -m llamarl.app.sim --from-run {run.path}); "
               f"{loop.generators} generator(s), max_staleness {loop.max_staleness}. "
               + " ".join(fit.notes))
    return pd.DataFrame(rows), caption


def _row(case: str, report: engine.Report) -> dict:
    row = {"case": case, "median step (s)": round(report.median_step_s, 3),
           "mean staleness": round(report.mean_staleness, 2)}
    row.update({f"idle {role}": round(value, 2) for role, value in sorted(report.idle.items())})
    return row


def what_if_tab(run: data.Run) -> None:
    rows, caption = table(run)
    if rows is None:
        st.info(caption)
        return
    st.dataframe(rows, hide_index=True)
    st.caption(caption)
