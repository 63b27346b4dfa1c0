"""Live dashboard over llamarl run directories.

    streamlit run dashboard/app.py -- --runs runs/

Pick one run to follow (a live run refreshes itself every few seconds, without a page
reload) or several to compare side by side. The page only reads ``runs/<run-id>/``
through ``llamarl.dashboard.data``; it never talks to the running app. ``?run=<id>`` or
``?compare=<id>,<id>`` in the address preselects runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable

# `streamlit run dashboard/app.py` puts dashboard/ first on sys.path, where this very file
# would shadow the top-level `app` package that llamarl.dashboard.data reads the schema from.
# Put the repository root there instead (which also finds `dashboard` without an install).
_DASHBOARD_DIR = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _DASHBOARD_DIR]
sys.path.insert(0, str(_DASHBOARD_DIR.parent))

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from llamarl.app import names# noqa: E402
from llamarl.dashboard import charts, data, episodes  # noqa: E402
from llamarl.dashboard.what_if import what_if_tab  # noqa: E402

log = logging.getLogger("llamarl.dashboard")

RUNS_ENV = "LLAMARL_RUNS_DIR"
REFRESH_CHOICES_S = (1, 2, 5, 10, 30)
TIMELINE_WINDOWS_S = {"last 30 s": 30.0, "last 2 min": 120.0, "last 10 min": 600.0, "whole run": None}
THROUGHPUT = [names.GEN_TOKENS_PER_S, names.TRAIN_TOKENS_PER_S]
LEARNING = [names.EVAL_ACCURACY, names.REWARD_TOTAL, names.LOSS, names.KL, names.RESPONSE_LEN]
AIPO = [names.AIPO_RATIO_MEAN, names.AIPO_RATIO_MAX, names.AIPO_FRAC_TRUNCATED]
# Why a step trains little: groups without signal, completions without an answer or cut off.
SIGNAL = [names.FRAC_ZERO_VAR, names.FRAC_NO_ANSWER, names.FRAC_CUT_OFF]
COUNTS = [names.DROPPED_STALE, names.TRAIN_SKIPPED_STEPS]
LOSSES = [names.FAULTS_LOST_GROUPS, names.FAULTS_OVERDUE_GROUPS, names.FAULTS_DUPLICATE_GROUPS, names.WEIGHT_REGROUPS]
# Scalars drawn by a dedicated view; the "All scalars" tab offers the rest.
SHOWN = {*THROUGHPUT, *LEARNING, *SIGNAL, *AIPO, *COUNTS, *LOSSES, names.GEN_SEQS_PER_S, names.TRAIN_SAMPLES_PER_S,
         names.TRAIN_STEPS_PER_MIN, names.TRAIN_STEP_S, names.IDLE_FRACTION, names.STALENESS_MEAN,
         names.STALENESS_MAX, names.DEVICE_UTILIZATION, names.DEVICE_MAX_MEMORY_GB, names.WEIGHTS_QUANTIZE_S}
# Prefixes of counters drawn in the Queues tab (what security refused: the Security tab).
DROP_PREFIXES = (names.QUARANTINED_PREFIX,)


def parser() -> argparse.ArgumentParser:
    """The dashboard's flags, after ``--`` on the streamlit command line."""
    p = argparse.ArgumentParser(prog="streamlit run dashboard/app.py --", allow_abbrev=False,
                                description="The llamarl dashboard: live charts of the runs in a runs directory.")
    p.add_argument("--runs", help=f"the runs directory to show (default: ${RUNS_ENV}, else runs/)")
    return p


def runs_dir_from_args(argv: list[str]) -> Path:
    """``--runs DIR`` after ``--`` on the streamlit command line, else $LLAMARL_RUNS_DIR, else runs/.
    ``--help`` prints the flags in the terminal that started streamlit; the page opens with
    the default."""
    try:
        args, _ = parser().parse_known_args(argv)
    except SystemExit:  # --help, or a malformed command line: it must not kill the page
        args = argparse.Namespace(runs=None)
    return Path(args.runs or os.environ.get(RUNS_ENV) or "runs")


def show_error(err: data.RunError) -> None:
    (st.info if err.level == "info" else st.error)(str(err))


def guarded(what: str, body: Callable[[], None]) -> None:
    """Runs ``body``; any failure becomes a message on the page, never a traceback."""
    try:
        body()
    except data.RunError as err:
        show_error(err)
    except Exception as err:  # the page must survive whatever a half-written run holds
        log.exception("dashboard failed while %s", what)
        st.error(f"Could not show {what}: {type(err).__name__}: {err}")


def chart(fig, key: str) -> None:
    # Plotly's own colours and template: the Streamlit theme draws neighbouring series in
    # two shades of blue. No mode bar: it covers the legend; drag still zooms.
    st.plotly_chart(fig, key=key, theme=None, config={"displaylogo": False, "displayModeBar": False})


def chart_pair(left: tuple, right: tuple) -> None:
    """Two charts side by side; each side is ``(figure, key)``."""
    for col, (fig, key) in zip(st.columns(2), (left, right)):
        with col:
            chart(fig, key)


# --------------------------------------------------------------------------- one run


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def headline(run: data.Run) -> None:
    h = run.headline()
    cols = st.columns(7)
    cols[0].metric("step", fmt(h.step, "d"))
    cols[1].metric("generated tokens/s", fmt(h.gen_tokens_per_s, ",.0f"),
                   help="all generator replicas, mean over the last 30 s of the run")
    cols[2].metric("trained tokens/s", fmt(h.train_tokens_per_s, ",.0f"),
                   help="mean over the last 30 s of the run")
    cols[3].metric("idle", fmt(None if h.idle_fraction is None else 100 * h.idle_fraction, ".1f", " %"),
                   help="share of all executors' time spent waiting, last 30 s")
    cols[4].metric("mean staleness", fmt(h.mean_staleness, ".2f"),
                   help=f"policy versions behind, rollouts used; bound max_staleness = {run.max_staleness}")
    version = "" if h.last_sync_version is None else f" (v{h.last_sync_version})"
    cols[5].metric(f"last sync{version}", fmt(h.last_sync_s, ".3f", " s"),
                   help="seconds the slowest receiver took for the newest weight version"
                        + ("" if h.last_sync_age_s is None else f"; {h.last_sync_age_s:.0f} s before the newest event"))
    cols[6].metric("last checkpoint", "—" if h.last_checkpoint_step is None else f"step {h.last_checkpoint_step}",
                   help="the newest saved policy (a Hugging Face directory; use it as --policy)"
                        + ("" if h.last_checkpoint_path is None else f": {h.last_checkpoint_path}"))


def throughput_tab(run: data.Run) -> None:
    chart_pair((charts.line_figure(run.scalar_series(THROUGHPUT, replicas="sum"), "Throughput (all replicas)",
                                   y_title="tokens/s", markers=resume_markers(run)), "tput-tokens"),
               (charts.line_figure(run.scalar_series([names.TRAIN_STEPS_PER_MIN]), "RL steps per minute",
                                   y_title="steps/min"), "tput-steps"))
    chart_pair((charts.line_figure(run.scalar_series([names.GEN_SEQS_PER_S, names.TRAIN_SAMPLES_PER_S],
                                                     replicas="sum"),
                                   "Sequences per second", y_title="seqs/s"), "tput-seqs"),
               (charts.line_figure(run.scalar_series([names.TRAIN_STEP_S]), "End-to-end step time",
                                   y_title="seconds"), "tput-step-s"))


def executors_tab(run: data.Run) -> None:
    chart_pair((charts.idle_figure(run.idle_fractions()), "exec-idle"),
               (charts.line_figure(run.scalar_series([names.IDLE_FRACTION]), "Idle fraction over time",
                                   y_title="idle share"), "exec-idle-t"))
    window = st.segmented_control("Timeline window", list(TIMELINE_WINDOWS_S), default="last 30 s",
                                  key="timeline-window")
    span = run.time_span()
    width = TIMELINE_WINDOWS_S.get(window or "last 30 s")
    start = None if span is None or width is None else max(0.0, span[1] - width)
    chart(charts.timeline_figure(run.intervals(start_s=start)), "exec-timeline")
    utilization = run.scalar_series([names.DEVICE_UTILIZATION])
    memory = run.scalar_series([names.DEVICE_MAX_MEMORY_GB])
    if not (utilization.empty and memory.empty):  # some executor runs on a GPU (CPU ones report none)
        chart_pair((charts.line_figure(utilization, "GPU utilisation per executor (NVML: the whole device)",
                                       y_title="percent"), "exec-gpu-util"),
                   (charts.line_figure(memory, "GPU peak memory per executor", y_title="GiB"), "exec-gpu-mem"))
        st.caption("On a GPU an executor's busy intervals end when the GPU has finished their work "
                   "(a stream synchronisation), so its idle share above is GPU idle time.")
    breakdown = run.idle_breakdown()
    if not breakdown.empty:
        with st.expander("Where the time went (seconds per activity)"):
            st.dataframe(breakdown, hide_index=True)
    members = run.scalar_series(prefix=names.MEMBERS_PREFIX)
    if not members.empty:  # runs recorded before executors could be lost have none
        chart_pair((charts.line_figure(members, "Executors alive", y_title="replicas"), "exec-members"),
                   (charts.line_figure(run.scalar_series(LOSSES), "After lost executors and messages (totals so far)",
                                       y_title="count"),
                    "exec-losses"))


def staleness_tab(run: data.Run) -> None:
    bound = run.max_staleness
    chart_pair((charts.staleness_histogram_figure(run.staleness_histogram(), bound), "stale-hist"),
               (charts.staleness_steps_figure(run.staleness_by_step(), bound), "stale-steps"))
    if bound is None:
        st.caption("The run's config has no max_staleness, so no bound is drawn.")
    if episodes.has_episodes(run):
        chart(episodes.versions_figure(run), "stale-ep-versions")
    if run.auto_staleness:
        auto_bound_section(run)
    mismatch = run.scalar_series(prefix=names.MISMATCH_PREFIX)
    if mismatch.empty:
        return
    precision = run.config.get("gen_precision", "fp32")
    rho_max = run.config.get("rho_max")
    stat = mismatch["name"].str.rsplit("/", n=1).str[-1]
    chart_pair((charts.line_figure(mismatch[stat.isin(["ratio_mean", "ratio_max"])],
                                   "Importance ratio pi/mu by lag",
                                   bound=float(rho_max) if isinstance(rho_max, (int, float)) else None,
                                   bound_label="rho_max"), "mismatch-ratio"),
               (charts.line_figure(mismatch[stat.isin(["kl", "frac_truncated"])],
                                   "KL(mu || pi) and share truncated, by lag"), "mismatch-kl"))
    st.caption(f"Generators at {precision}. Lag 0: sampled with the weights trained on, so what "
               "separates mu from pi is the generators' precision; lag k adds k optimizer steps.")


def auto_bound_section(run: data.Run) -> None:
    """``--max-staleness auto``: the bound over the run, what it followed, every change and why."""
    chart_pair((charts.line_figure(run.scalar_series([names.STALENESS_BOUND, names.STALENESS_BLOCKED]),
                                   "Staleness bound (auto) and the generators' share of time blocked on it"),
                "auto-bound"),
               (charts.line_figure(run.scalar_series([names.AIPO_ESS, names.AIPO_KL_BEHAVIOUR,
                                                      names.AIPO_FRAC_TRUNCATED]),
                                   "What it weighs: ESS of the AIPO weights, KL(mu || pi), share truncated"),
                "auto-ratios"))
    changes = run.bound_changes()
    st.caption(f"max_staleness = auto: {len(changes)} change(s). Raised while the generators wait on the "
               "bound and the ratios stay tame; lowered when they do not (docs/staleness.md).")
    if not changes.empty:
        st.dataframe(changes, hide_index=True)


def weight_sync_tab(run: data.Run) -> None:
    chart_pair((charts.weight_sync_figure(run.weight_sync()), "sync-versions"),
               (charts.weight_sync_senders_figure(run.weight_sync_by_sender()), "sync-senders"))
    quantize = run.scalar_series([names.WEIGHTS_QUANTIZE_S])
    if not quantize.empty:
        chart(charts.line_figure(quantize, f"Quantization to {run.config.get('gen_precision', '?')} per "
                                           "version (each generator)", y_title="seconds"), "sync-quantize")
    receivers = run.weight_sync_receivers()
    if not receivers.empty:
        st.dataframe(receivers, hide_index=True)
    senders = run.weight_sync_senders()
    if not senders.empty:
        st.caption("Senders: each trainer rank sends its own shard straight to every generator.")
        st.dataframe(senders, hide_index=True)


def resume_markers(run: data.Run) -> list[tuple[float, str]]:
    return [(t, f"resumed at step {step}") for step, t in run.resumes()]


def learning_tab(run: data.Run) -> None:
    marks = resume_markers(run)
    chart_pair((charts.rewards_figure(run.rewards()), "learn-rewards"),
               (charts.line_figure(run.scalar_series([names.EVAL_ACCURACY, names.REWARD_TOTAL]),
                                   "Accuracy and mean reward", markers=marks), "learn-acc"))
    chart_pair((charts.line_figure(run.scalar_series([names.LOSS]), "AIPO loss", markers=marks), "learn-loss"),
               (charts.line_figure(run.scalar_series([names.KL]), "KL to reference", markers=marks), "learn-kl"))
    chart(charts.line_figure(run.scalar_series(SIGNAL), "Why a step learns little (shares per step)",
                             y_title="share", markers=marks), "learn-signal")
    chart_pair((charts.line_figure(run.scalar_series(AIPO), "AIPO importance ratio"), "learn-aipo"),
               (charts.line_figure(run.scalar_series([names.RESPONSE_LEN]), "Response length",
                                   y_title="tokens"), "learn-len"))
    reasons = run.quarantine_reasons()
    if not reasons.empty:
        with st.expander("Quarantined rollouts (reward could not be computed)"):
            st.dataframe(reasons, hide_index=True)


def queues_tab(run: data.Run) -> None:
    drops = pd.concat([run.scalar_series(COUNTS)] + [run.scalar_series(prefix=p) for p in DROP_PREFIXES])
    chart_pair((charts.queues_figure(run.queue_depths()), "queues-depth"),
               (charts.line_figure(drops, "Dropped and quarantined (counts so far)",
                                   y_title="count"), "queues-dropped"))


def security_tab(run: data.Run) -> None:
    counts = run.security_counts()
    st.caption("Frames dropped on receipt by reason (security/rejected_frames/: bad tag, malformed, "
               "replay, version from the future, a signed message that breaks its format) and "
               "anything else refused for security (security/...): each is counted and the run "
               "goes on. too_old (a version below trainer version - max_staleness) is "
               f"usually ordinary staleness: the same groups are {names.DROPPED_STALE} in the Queues tab.")
    if counts.empty:
        st.success("Nothing refused: no bad frame, replay or altered weight version was seen.")
        return
    totals = counts.groupby("name", as_index=False).agg(count=("count", "sum"), processes=("role", "size"))
    st.dataframe(totals.sort_values(["count", "name"], ascending=[False, True]), hide_index=True)
    chart(charts.line_figure(run.scalar_series(prefix=names.SECURITY_PREFIX), "Refused so far, by reason "
                             "and process", y_title="count"), "security-counts")
    with st.expander("By process"):
        st.dataframe(counts, hide_index=True)


def other_scalars_tab(run: data.Run) -> None:
    others = [s for s in run.scalar_names()
              if s not in SHOWN and not s.startswith((names.QUEUE_PREFIX, names.MEMBERS_PREFIX, names.MISMATCH_PREFIX,
                                                      *DROP_PREFIXES, names.SECURITY_PREFIX, names.ENV_PREFIX))]
    if not others:
        st.info("Every scalar this run records is drawn in the other tabs.")
        return
    picked = st.multiselect("Scalars", others, default=others[:4], key="other-scalars")
    for name in picked:
        chart(charts.line_figure(run.scalar_series([name]), name), f"other-{name}")


TABS: dict[str, Callable[[data.Run], None]] = {
    "Throughput": throughput_tab,
    "Executors": executors_tab,
    "Off-policy": staleness_tab,
    "Weight sync": weight_sync_tab,
    "Learning": learning_tab,
    "Episodes": episodes.episodes_tab,
    "Queues": queues_tab,
    "Security": security_tab,
    "All scalars": other_scalars_tab,
    "What if": what_if_tab,
}


def run_page(path: Path) -> None:
    with data.open_run(path) as run:
        live = run.is_live()
        st.subheader(f"{run.run_id}" + (" · live" if live else ""))
        span = run.time_span()
        st.caption(f"{path} · {'still being written' if live else 'not written to in the last minute'}"
                   + ("" if span is None else f" · {span[1]:,.0f} s of events")
                   + f" · max_staleness = {'auto, up to ' if run.auto_staleness else ''}{run.max_staleness}"
                   + "".join(f" · resumed at step {step}" for step, _ in run.resumes()))
        with st.expander("Config"):
            st.json(run.config, expanded=False)
        if run.is_empty():
            st.info(f"Run {run.run_id!r} has opened its metrics database but recorded no events yet. "
                    "This page refreshes itself while the run is live.")
            return
        headline(run)
        # Only the open tab runs its queries: a refresh of a long run costs one view, not eight.
        for tab, (name, body) in zip(st.tabs(list(TABS), key="tab", on_change="rerun"), TABS.items()):
            if tab.open is False:
                continue
            with tab:
                guarded(f"the {name} view", lambda body=body: body(run))


# --------------------------------------------------------------------------- compare


def compare_page(paths: list[Path]) -> None:
    runs: dict[str, data.Run] = {}
    try:
        for path in paths:
            try:
                runs[path.name] = data.open_run(path)
            except data.RunError as err:
                show_error(err)
        if not runs:
            return
        st.subheader("Compare: " + " vs ".join(runs))
        st.dataframe(compare_table(runs), hide_index=True)
        colors = charts.run_colors(list(runs))
        chart_pair((charts.idle_compare_figure({k: r.idle_fractions() for k, r in runs.items()}, colors),
                    "cmp-idle"),
                   (charts.staleness_compare_figure({k: r.staleness_histogram() for k, r in runs.items()},
                                                    colors), "cmp-stale"))
        grid = [(names.GEN_TOKENS_PER_S, "Generated tokens/s (all replicas)", "sum"),
                (names.TRAIN_TOKENS_PER_S, "Trained tokens/s", "sum"),
                (names.TRAIN_STEPS_PER_MIN, "RL steps per minute", "mean"),
                (names.REWARD_TOTAL, "Mean reward", "mean"),
                (names.EVAL_ACCURACY, "Accuracy", "mean"),
                (names.STALENESS_MEAN, "Mean staleness per step", "mean")]
        for i in range(0, len(grid), 2):
            for col, (name, title, fold) in zip(st.columns(2), grid[i:i + 2]):
                with col:
                    frames = [r.scalar_series([name], replicas=fold).assign(run=k) for k, r in runs.items()]
                    chart(charts.line_figure(pd.concat(frames), title, run_column="run", colors=colors),
                          f"cmp-{name}")
    finally:
        for run in runs.values():
            run.close()


def compare_table(runs: dict[str, data.Run]) -> pd.DataFrame:
    rows = []
    for run_id, run in runs.items():
        h = run.headline()
        rows.append({"run": run_id, "max_staleness": run.max_staleness, "step": h.step,
                     "elapsed s": h.elapsed_s, "gen tokens/s": h.gen_tokens_per_s,
                     "train tokens/s": h.train_tokens_per_s,
                     "idle %": None if h.idle_fraction is None else 100 * h.idle_fraction,
                     "mean staleness": h.mean_staleness, "last sync s": h.last_sync_s,
                     "last checkpoint": h.last_checkpoint_step})
    return pd.DataFrame(rows).round(3)


# --------------------------------------------------------------------------- page


def sidebar(infos: list[data.RunInfo]) -> tuple[str, list[data.RunInfo], float | None]:
    by_id = {i.run_id: i for i in infos}
    params = st.query_params
    compare_ids = [r for r in params.get("compare", "").split(",") if r in by_id]
    mode = st.sidebar.radio("View", ["One run", "Compare runs"], index=1 if compare_ids else 0, key="mode")
    if mode == "One run":
        ids = list(by_id)
        wanted = params.get("run")
        index = ids.index(wanted) if wanted in by_id else next(
            (k for k, i in enumerate(infos) if i.status == "ok"), 0)
        picked = st.sidebar.selectbox("Run", ids, index=index, format_func=lambda r: by_id[r].label, key="run")
        chosen = [by_id[picked]]
    else:
        default = compare_ids or [i.run_id for i in infos if i.status == "ok"][:2]
        picked = st.sidebar.multiselect("Runs", list(by_id), default=default,
                                        format_func=lambda r: by_id[r].label, key="runs")
        chosen = [by_id[r] for r in picked]
    auto = st.sidebar.toggle("Auto-refresh live runs", value=True, key="auto")
    every = st.sidebar.select_slider("Refresh every (s)", REFRESH_CHOICES_S, value=2, key="every",
                                     disabled=not auto)
    refresh = float(every) if auto and any(i.live for i in chosen) else None
    with st.sidebar.expander(f"All runs ({len(infos)})"):
        for info in infos:
            st.markdown(f"**{info.run_id}** · {info.status}" + (" · live" if info.live else "")
                        + (f"  \n{info.message}" if info.message else ""))
    st.sidebar.button("Rescan runs directory", key="rescan")
    return mode, chosen, refresh


def main() -> None:
    st.set_page_config(page_title="llamarl dashboard", page_icon="🦙", layout="wide")
    st.title("llamarl runs")
    root = Path(st.sidebar.text_input("Runs directory", str(runs_dir_from_args(sys.argv[1:])), key="root"))
    try:
        infos = data.list_runs(root)
    except data.RunError as err:
        show_error(err)
        return
    if not infos:
        st.info(f"No runs in {str(root)!r} yet. Start one (for example `python -m llamarl.app.roles.local`) "
                "and it appears here.")
        return
    mode, chosen, refresh = sidebar(infos)
    if not chosen:
        st.info("Pick one or more runs in the sidebar.")
        return
    if refresh is not None:
        st.sidebar.caption(f"Following live run(s): refreshing every {refresh:g} s.")

    @st.fragment(run_every=refresh)
    def live_view() -> None:
        if mode == "One run":
            info = chosen[0]
            if info.status not in ("ok", "empty"):
                (st.info if info.status == "no metrics" else st.error)(info.message)
                return
            guarded(f"run {info.run_id!r}", lambda: run_page(info.path))
        else:
            guarded("the comparison", lambda: compare_page([i.path for i in chosen]))

    live_view()


if __name__ == "__main__":  # streamlit runs the page as __main__; importing it runs nothing
    main()
