"""The Episodes view: what a run's generators recorded about multi-turn episodes (``--env``).

Generators record running totals per batch under ``env/`` (``llamarl.app.names.ENV_PREFIX``):
episodes, turns, tool calls, tool errors and episode ends by reason, summed environment
step time, and the episodes per length bucket and per number of weight versions. This
module turns them into the view's figures: per-episode rates over time, the latest totals
by reason, the length and version distributions, and the environment's time per batch
beside the generators' and the trainer's (from the busy intervals). A run without
episodes shows a one-line note instead.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from llamarl.app import names
from llamarl.dashboard import charts
from llamarl.dashboard.run import Run

EPISODES, TURNS, TOOL_CALLS, ENV_STEP_S = (names.ENV_PREFIX + k for k in
                                           ("episodes", "episode_turns", "tool_calls", "env_step_s"))
TOOL_ERRORS_PREFIX = names.ENV_PREFIX + "tool_errors/"
ENDS_PREFIX = names.ENV_PREFIX + "episode_end/"


def has_episodes(run: Run) -> bool:
    return not run.scalar_series([EPISODES]).empty


def totals(run: Run, prefix: str) -> pd.DataFrame:
    """The newest running total of every ``prefix<key>`` scalar, summed over generators.
    Columns ``key, value``, numeric keys in numeric order."""
    df = run.scalar_series(prefix=prefix)
    if df.empty:
        return pd.DataFrame({"key": pd.Series(dtype=str), "value": pd.Series(dtype=float)})
    last = df.sort_values("t").groupby(["name", "role", "replica"], as_index=False).last()
    out = last.groupby("name", as_index=False)["max"].sum().rename(columns={"max": "value"})
    out["key"] = out["name"].str.slice(len(prefix))
    numeric = pd.to_numeric(out["key"], errors="coerce")
    out = out.assign(_order=numeric).sort_values(["_order", "key"]) if numeric.notna().all() else out.sort_values("key")
    return out[["key", "value"]].reset_index(drop=True)


def per_episode(run: Run) -> pd.DataFrame:
    """Turns and tool calls per episode over time (each generator's totals so far), as a
    ``scalar_series`` frame named ``turns per episode`` and ``tool calls per episode``."""
    df = run.scalar_series([EPISODES, TURNS, TOOL_CALLS])
    if df.empty:
        return df
    wide = df.pivot_table(index=["role", "replica", "t"], columns="name", values="max").reset_index()
    frames = []
    for name, label in ((TURNS, "turns per episode"), (TOOL_CALLS, "tool calls per episode")):
        if name in wide:
            part = wide[["role", "replica", "t"]].assign(name=label, value=wide[name] / wide[EPISODES].where(
                wide[EPISODES] > 0), step=pd.NA)
            frames.append(part.dropna(subset=["value"]))
    return pd.concat(frames, ignore_index=True) if frames else df.iloc[0:0]


def time_per_batch(run: Run) -> pd.DataFrame:
    """Mean seconds of a generator batch's generation (its busy ``generate`` intervals,
    which hold the environment steps run beside decoding), of the environment steps of a
    batch (summed over steps that ran in parallel, so it can exceed the generation time),
    and of a trainer step's ``train``. Columns ``what, seconds, count``."""
    breakdown = run.idle_breakdown()
    rows = []
    generate = breakdown[(breakdown["role"] == "generator") & (breakdown["what"] == "generate")]
    batches = int(generate["n"].sum()) if not generate.empty else 0
    if batches:
        rows.append(("generation (per batch)", float(generate["seconds"].sum()) / batches, batches))
        env_s = totals(run, names.ENV_PREFIX)
        env_s = env_s[env_s["key"] == ENV_STEP_S[len(names.ENV_PREFIX):]]
        if not env_s.empty:
            rows.append(("environment steps (per batch, summed)", float(env_s["value"].iloc[0]) / batches, batches))
    train = breakdown[(breakdown["role"] == "trainer") & (breakdown["what"] == "train")]
    if not train.empty and int(train["n"].sum()):
        rows.append(("training (per step)", float(train["seconds"].sum()) / int(train["n"].sum()), int(train["n"].sum())))
    return pd.DataFrame(rows, columns=["what", "seconds", "count"])


def bar_figure(df: pd.DataFrame, title: str, *, x: str = "key", y: str = "value", x_title: str = "",
               y_title: str = "episodes") -> go.Figure:
    """One bar per row of ``df``."""
    if df.empty:
        return charts.empty_figure(title)
    fig = go.Figure(go.Bar(x=df[x].astype(str), y=df[y]))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=charts.HEIGHT,
                      template="plotly_white", margin=dict(l=10, r=10, t=64, b=10))
    fig.update_xaxes(type="category")
    return fig


def versions_figure(run: Run) -> go.Figure:
    """Episodes by the number of weight versions their turns were sampled with."""
    return bar_figure(totals(run, names.ENV_EPISODE_VERSIONS_PREFIX), "Weight versions per episode",
                      x_title="versions in one episode")


def episodes_tab(run: Run) -> None:
    """The Episodes tab (registered in ``llamarl.dashboard.app``)."""
    import streamlit as st

    if not has_episodes(run):
        st.info("This run recorded no episodes: its generators ran without --env (docs/environments.md).")
        return
    cols = st.columns(2)
    cols[0].plotly_chart(charts.line_figure(per_episode(run), "Turns and tool calls per episode (running means)",
                                            y_title="per episode"), key="ep-rates")
    cols[1].plotly_chart(bar_figure(totals(run, names.ENV_EPISODE_TOKENS_PREFIX), "Episode length",
                                    x_title="tokens after the prompt, up to"), key="ep-lengths")
    cols = st.columns(2)
    cols[0].plotly_chart(bar_figure(totals(run, TOOL_ERRORS_PREFIX), "Tool errors by reason", x_title="reason",
                                    y_title="calls"), key="ep-tool-errors")
    cols[1].plotly_chart(bar_figure(totals(run, ENDS_PREFIX), "Episode ends by reason", x_title="reason"),
                         key="ep-ends")
    cols = st.columns(2)
    timing = time_per_batch(run)
    cols[0].plotly_chart(bar_figure(timing, "Environment, generation and training time", x="what", y="seconds",
                                    y_title="seconds"), key="ep-times")
    cols[1].plotly_chart(versions_figure(run), key="ep-versions")
    tools = totals(run, names.ENV_PREFIX)
    tools = tools[tools["key"].isin(["episodes", "episode_turns", "tool_calls", "env_step_s"])]
    st.dataframe(pd.concat([tools.rename(columns={"key": "total"}),
                            timing.rename(columns={"what": "total", "seconds": "value"})[["total", "value"]]]),
                 hide_index=True)
    st.caption("Environment steps run on threads beside decoding, so their summed time per batch can exceed "
               "the batch's generation time; what they cost is the part of it the policy waits on.")


__all__ = ["bar_figure", "episodes_tab", "has_episodes", "per_episode", "time_per_batch", "totals",
           "versions_figure"]
