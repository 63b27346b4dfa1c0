"""Plotly figure builders over the DataFrames of ``llamarl.dashboard.data``.

Each builder takes frames as ``Run`` returns them and gives back a ``go.Figure``; none
reads a database or knows about Streamlit, so a notebook can call them as well.
Time axes are seconds since the run started, switched to minutes for long runs.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

BUSY_COLOR, IDLE_COLOR, DROPPED_COLOR, BOUND_COLOR = "#1f77b4", "#d3d7de", "#d62728", "#d62728"
RESUME_COLOR = "#7f7f7f"
HEIGHT = 340
# The title sits at the top of the margin and the legend in a row of its own under it, on
# the plot's top edge: a legend in the title's row ran into long titles and run names.
_LAYOUT = dict(height=HEIGHT, margin=dict(l=10, r=10, t=64, b=10), hovermode="x unified",
               template="plotly_white", title_y=0.985, title_yanchor="top",
               legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0.0))


def run_colors(run_ids: list[str]) -> dict[str, str]:
    """One colour per run, the same in every comparison chart."""
    palette = qualitative.Plotly
    return {run_id: palette[i % len(palette)] for i, run_id in enumerate(run_ids)}


def _time_scale(t: pd.Series) -> tuple[float, str]:
    """Seconds per axis unit and the axis title: minutes once a run passes 20 minutes."""
    if len(t) and float(t.max()) > 1200:
        return 60.0, "time since start (min)"
    return 1.0, "time since start (s)"


def _time_axis(t: pd.Series) -> tuple[pd.Series, str]:
    scale, title = _time_scale(t)
    return t / scale, title


def series_label(row: pd.Series, *, with_name: bool, with_role: bool) -> str:
    parts = [str(row["name"])] if with_name else []
    if with_role:
        parts.append(str(row["role"]) + ("" if row["replica"] < 0 else f" {int(row['replica'])}"))
    return " · ".join(parts) or str(row["name"])


def empty_figure(title: str, message: str = "no data recorded yet") -> go.Figure:
    fig = go.Figure(layout=dict(title=title, **_LAYOUT))
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14, color="gray"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def line_figure(df: pd.DataFrame, title: str, *, y_title: str = "", bound: float | None = None,
                bound_label: str = "", run_column: str | None = None,
                colors: Mapping[str, str] | None = None,
                markers: Sequence[tuple[float, str]] = ()) -> go.Figure:
    """One line per series of a ``scalar_series`` frame (per run too, with ``run_column``,
    coloured by ``colors[run]``); ``markers``: ``(seconds since start, label)`` drawn as
    vertical lines (where a run was resumed)."""
    if df.empty:
        return empty_figure(title)
    x, x_title = _time_axis(df["t"])
    df = df.assign(_x=x)
    with_name = df["name"].nunique() > 1
    keys = ["name", "role", "replica"]
    with_role = df.groupby("name")[["role", "replica"]].apply(lambda g: len(g.drop_duplicates()) > 1).any()
    if run_column:
        keys = [run_column, *keys]
    fig = go.Figure()
    for key, g in df.groupby(keys, sort=run_column is None):
        label = series_label(g.iloc[0], with_name=with_name, with_role=with_role)
        color = None
        if run_column:
            label = f"{key[0]} · {label}" if (with_name or with_role) else str(key[0])
            color = (colors or {}).get(key[0])
        fig.add_trace(go.Scatter(x=g["_x"], y=g["value"], mode="lines", name=label, line_color=color,
                                 customdata=g[["step"]], hovertemplate="%{y:.4g} (step %{customdata[0]})"))
    if bound is not None:
        fig.add_hline(y=bound, line=dict(color=BOUND_COLOR, dash="dash"),
                      annotation_text=bound_label or f"bound {bound:g}", annotation_position="top left")
    scale, _ = _time_scale(df["t"])
    for t, label in markers:
        fig.add_vline(x=t / scale, line=dict(color=RESUME_COLOR, dash="dot"), annotation_text=label,
                      annotation_position="top right")
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, showlegend=True, **_LAYOUT)
    return fig


def idle_figure(df: pd.DataFrame, title: str = "Device idle fraction per executor") -> go.Figure:
    """Stacked busy/idle share per executor replica from ``Run.idle_fractions``."""
    if df.empty:
        return empty_figure(title, "no busy/idle intervals recorded yet")
    lanes = df["role"] + " " + df["replica"].astype(int).astype(str)
    busy = 1.0 - df["idle_fraction"].fillna(0.0)
    fig = go.Figure([
        go.Bar(y=lanes, x=busy, name="busy", orientation="h", marker_color=BUSY_COLOR,
               hovertemplate="%{y}: %{x:.0%} busy<extra></extra>"),
        go.Bar(y=lanes, x=df["idle_fraction"], name="idle", orientation="h", marker_color=IDLE_COLOR,
               text=[f"{v:.0%} idle" for v in df["idle_fraction"].fillna(0.0)], textposition="inside",
               hovertemplate="%{y}: %{x:.0%} idle<extra></extra>"),
    ])
    fig.update_layout(title=title, barmode="stack", xaxis=dict(tickformat=".0%", range=[0, 1]),
                      **{**_LAYOUT, "hovermode": "closest", "height": 120 + 40 * len(df)})
    fig.update_yaxes(autorange="reversed")
    return fig


def idle_compare_figure(frames: Mapping[str, pd.DataFrame], colors: Mapping[str, str] | None = None,
                        title: str = "Device idle fraction per executor") -> go.Figure:
    """Idle fraction of each role, one bar per run: the sync-against-async picture."""
    fig = go.Figure()
    for run_id, df in frames.items():
        if df.empty:
            continue
        per_role = df.groupby("role")[["idle_s", "total_s"]].sum()
        fig.add_trace(go.Bar(x=per_role.index, y=per_role["idle_s"] / per_role["total_s"], name=run_id,
                             marker_color=(colors or {}).get(run_id),
                             hovertemplate="%{x}: %{y:.0%} idle<extra>" + run_id + "</extra>"))
    if not fig.data:
        return empty_figure(title, "no busy/idle intervals recorded yet")
    fig.update_layout(title=title, barmode="group", yaxis=dict(tickformat=".0%", range=[0, 1]),
                      **{**_LAYOUT, "hovermode": "closest"})
    return fig


def timeline_figure(df: pd.DataFrame, title: str = "Executor timeline (busy / idle)") -> go.Figure:
    """One lane per executor replica with its busy and idle intervals (``Run.intervals``).

    Recorded intervals draw as busy and idle bars; merged slices (``n`` > 1, a long
    window) draw shaded by their busy fraction.
    """
    if df.empty:
        return empty_figure(title, "no busy/idle intervals in this window")
    scale, x_title = _time_scale(df["t1"])
    df = df.assign(_x0=df["t0"] / scale, _w=(df["t1"] - df["t0"]) / scale,
                   lane=df["role"] + " " + df["replica"].astype(int).astype(str))
    lanes = sorted(df["lane"].unique(), key=_lane_order)
    fig = go.Figure()
    if int(df["n"].max()) <= 1:
        for kind, color, frame in (("busy", BUSY_COLOR, df[df["busy_fraction"] >= 0.5]),
                                   ("idle", IDLE_COLOR, df[df["busy_fraction"] < 0.5])):
            fig.add_trace(go.Bar(y=frame["lane"], x=frame["_w"], base=frame["_x0"], orientation="h",
                                 name=kind, marker=dict(color=color, line=dict(width=0)),
                                 customdata=frame[["what"]],
                                 hovertemplate="%{y}: " + kind + " %{customdata[0]}<br>%{base:.2f} + %{x:.2f}"
                                               "<extra></extra>"))
    else:
        fig.add_trace(go.Bar(y=df["lane"], x=df["_w"], base=df["_x0"], orientation="h", name="busy share",
                             marker=dict(color=df["busy_fraction"], cmin=0, cmax=1, line=dict(width=0),
                                         colorscale=[[0, IDLE_COLOR], [1, BUSY_COLOR]],
                                         colorbar=dict(title="busy", tickformat=".0%", thickness=12)),
                             customdata=df[["what"]],
                             hovertemplate="%{y}: %{customdata[0]}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=x_title, barmode="overlay", bargap=0.25,
                      **{**_LAYOUT, "hovermode": "closest", "height": 140 + 45 * len(lanes)})
    fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1])
    return fig


def _lane_order(lane: str) -> tuple[int, str]:
    order = {"trainer": 0, "generator": 1, "reward": 2}
    return order.get(lane.split(" ")[0], 9), lane


def staleness_histogram_figure(df: pd.DataFrame, bound: int | None,
                               title: str = "Off-policy staleness of consumed rollouts") -> go.Figure:
    """Rollouts per staleness value (used and dropped) with the ``max_staleness`` bound."""
    if df.empty:
        return empty_figure(title, "no rollouts consumed yet")
    fig = go.Figure([
        go.Bar(x=df["staleness"], y=df["used"], name="used", marker_color=BUSY_COLOR),
        go.Bar(x=df["staleness"], y=df["dropped"], name="dropped (over bound)", marker_color=DROPPED_COLOR),
    ])
    _add_bound(fig, bound, vertical=True)
    fig.update_layout(title=title, barmode="stack", xaxis=dict(title="staleness (policy versions)", dtick=1),
                      yaxis_title="rollouts", **{**_LAYOUT, "hovermode": "closest"})
    return fig


def staleness_compare_figure(frames: Mapping[str, pd.DataFrame], colors: Mapping[str, str] | None = None,
                             title: str = "Staleness distribution (share of rollouts)") -> go.Figure:
    fig = go.Figure()
    for run_id, df in frames.items():
        total = (df["used"] + df["dropped"]).sum() if not df.empty else 0
        if total:
            fig.add_trace(go.Bar(x=df["staleness"], y=(df["used"] + df["dropped"]) / total, name=run_id,
                                 marker_color=(colors or {}).get(run_id)))
    if not fig.data:
        return empty_figure(title, "no rollouts consumed yet")
    fig.update_layout(title=title, barmode="group", xaxis=dict(title="staleness (policy versions)", dtick=1),
                      yaxis=dict(tickformat=".0%"), **{**_LAYOUT, "hovermode": "closest"})
    return fig


def staleness_steps_figure(df: pd.DataFrame, bound: int | None,
                           title: str = "Staleness per training step") -> go.Figure:
    """Mean (of used rollouts) and max staleness per step, with the bound drawn."""
    if df.empty:
        return empty_figure(title, "no rollouts consumed yet")
    fig = go.Figure([
        go.Scatter(x=df["step"], y=df["mean"], mode="lines", name="mean (used)", line_color=BUSY_COLOR),
        go.Scatter(x=df["step"], y=df["max"], mode="lines", name="max (incl. dropped)",
                   line=dict(color="#ff7f0e", shape="hv")),
    ])
    if df["dropped"].sum() > 0:
        dropped = df[df["dropped"] > 0]
        fig.add_trace(go.Bar(x=dropped["step"], y=dropped["dropped"], name="dropped", yaxis="y2",
                             marker_color=DROPPED_COLOR, opacity=0.35))
        fig.update_layout(yaxis2=dict(title="dropped", overlaying="y", side="right", showgrid=False))
    _add_bound(fig, bound, vertical=False)
    fig.update_layout(title=title, xaxis_title="training step", yaxis_title="versions behind", **_LAYOUT)
    fig.update_yaxes(rangemode="tozero")
    if bound is not None:  # keep the bound in view when every rollout is fresh
        fig.update_yaxes(range=[0, max(bound, float(df["max"].max())) + 1])
    return fig


def _add_bound(fig: go.Figure, bound: int | None, *, vertical: bool) -> None:
    if bound is None:
        return
    label = f"max_staleness = {bound}"
    if vertical:
        fig.add_vline(x=bound + 0.5, line=dict(color=BOUND_COLOR, dash="dash"), annotation_text=label,
                      annotation_position="top right")
    else:
        fig.add_hline(y=bound, line=dict(color=BOUND_COLOR, dash="dash"), annotation_text=label,
                      annotation_position="top left")


def weight_sync_figure(df: pd.DataFrame, title: str = "Weight sync per version") -> go.Figure:
    """Seconds (mean and slowest receiver) and payload per weight version."""
    if df.empty:
        return empty_figure(title, "no weight syncs recorded yet")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=df["version"], y=df["bytes"] / 1e6, name="MB per receiver", marker_color=IDLE_COLOR),
                  secondary_y=True)
    fig.add_trace(go.Scatter(x=df["version"], y=df["seconds_mean"], mode="lines+markers", name="seconds (mean)",
                             line_color=BUSY_COLOR), secondary_y=False)
    fig.add_trace(go.Scatter(x=df["version"], y=df["seconds_max"], mode="lines", name="seconds (slowest)",
                             line=dict(color="#ff7f0e", dash="dot")), secondary_y=False)
    fig.update_layout(title=title, xaxis_title="policy version", **_LAYOUT)
    fig.update_yaxes(title_text="seconds", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title_text="MB", secondary_y=True, showgrid=False, rangemode="tozero")
    return fig


def weight_sync_senders_figure(df: pd.DataFrame, title: str = "Weight sync per sender") -> go.Figure:
    """Seconds each trainer rank spent sending its shard, per weight version
    (``Run.weight_sync_by_sender``); the hover gives its bytes."""
    if df.empty:
        return empty_figure(title, "no sender recorded yet")
    fig = go.Figure()
    for sender, g in df.groupby("sender"):
        fig.add_trace(go.Scatter(x=g["version"], y=g["seconds"], mode="lines+markers", name=str(sender),
                                 customdata=g["bytes"] / 1e6, hovertemplate="%{y:.3f} s, %{customdata:.1f} MB"))
    fig.update_layout(title=title, xaxis_title="policy version", yaxis_title="seconds", **_LAYOUT)
    fig.update_yaxes(rangemode="tozero")
    return fig


def rewards_figure(df: pd.DataFrame, title: str = "Reward per component") -> go.Figure:
    """Mean score of each reward component over time (``Run.rewards``)."""
    if df.empty:
        return empty_figure(title, "no rewards recorded yet")
    x, x_title = _time_axis(df["t"])
    fig = go.Figure()
    for component, g in df.assign(_x=x).groupby("component"):
        fig.add_trace(go.Scatter(x=g["_x"], y=g["mean"], mode="lines", name=str(component),
                                 customdata=g[["step", "n", "quarantined"]],
                                 hovertemplate="%{y:.3f} (step %{customdata[0]}, %{customdata[1]} scored, "
                                               "%{customdata[2]} quarantined)"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="mean reward", **_LAYOUT)
    return fig


def queues_figure(df: pd.DataFrame, title: str = "Queue depths") -> go.Figure:
    """Depth of each queue over time (``Run.queue_depths``)."""
    if df.empty:
        return empty_figure(title, "no queue depths recorded yet")
    return line_figure(df.assign(name=df["queue"]), title, y_title="items")
