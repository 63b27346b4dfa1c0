"""Serve the dashboard on loopback and photograph it in headless Chromium.

    python -m llamarl.dashboard.screenshot --runs runs/ --out docs/dashboard.png [--run ID] [--tab Executors]

Starts ``streamlit run dashboard/app.py`` on a free 127.0.0.1 port, loads the page in
headless Chromium (selenium + chromedriver), waits until the plotly charts are drawn,
fails if the page shows an exception, and saves a PNG. The browser test in
``tests/test_dashboard_browser.py`` goes through the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from llamarl.app.names import free_port

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

APP = Path(__file__).with_name("app.py")
CHROMIUM = os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER_BIN", "/usr/bin/chromedriver")
# Flags that keep Chromium off the network and free of first-run state.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-quic", "--no-first-run",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def browser_missing() -> str | None:
    """Why no screenshot can be taken here, or None when Chromium and chromedriver exist."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            return f"{path} not found (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    return None


@contextlib.contextmanager
def serve(runs_dir: str | Path, *, port: int | None = None, timeout_s: float = 60.0,
          log_path: str | Path | None = None) -> Iterator[str]:
    """Runs the dashboard over ``runs_dir`` on loopback; yields its URL once healthy."""
    port = port or free_port(span=1)
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP), "--server.port", str(port),
           "--server.address", "127.0.0.1", "--server.headless", "true",
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--client.toolbarMode", "viewer",
           "--", "--runs", str(runs_dir)]
    log_file = open(log_path, "w") if log_path else tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, timeout_s, log_file)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log_file.close()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_file) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode} before serving {url}:\n{_tail(log_file)}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"streamlit did not answer {url}/_stcore/health within {timeout_s:.0f} s:\n"
                       f"{_tail(log_file)}")


def _tail(log_file, n: int = 4000) -> str:
    try:
        log_file.flush()
        log_file.seek(0)
        return log_file.read()[-n:]
    except (OSError, ValueError):
        return "(no log)"


@dataclass(kw_only=True)
class PageReport:
    """What the page showed when it was photographed."""

    charts: int
    """Number of drawn plotly charts (``.js-plotly-plot``) on the visible page."""
    exceptions: list[str]
    """Text of every ``stException`` block, plus a note if the page says "Traceback"."""
    errors: list[str]
    """Text of every ``st.error`` box."""
    text: str
    """The page's visible text, for assertions."""


@contextlib.contextmanager
def browser(*, width: int = 1600, height: int = 1200) -> Iterator["WebDriver"]:
    """Headless Chromium with a fresh profile, driven by chromedriver; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="llamarl-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def capture(url: str, out_png: str | Path, *, min_charts: int = 1, timeout_s: float = 90.0,
            tab: str | None = None, driver: "WebDriver | None" = None, width: int = 1600,
            height: int = 1200) -> PageReport:
    """Loads ``url`` (in ``driver``, else a fresh headless Chromium), waits for ``min_charts``
    drawn charts and a page that has finished running, and saves the whole page as ``out_png``."""
    if driver is None:
        with browser(width=width, height=height) as fresh:
            return capture(url, out_png, min_charts=min_charts, timeout_s=timeout_s, tab=tab,
                           driver=fresh, width=width, height=height)
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.set_window_size(width, height)
    driver.set_page_load_timeout(timeout_s)
    driver.get(url)
    wait = WebDriverWait(driver, timeout_s, poll_frequency=0.25)

    def charts_drawn(d) -> bool:
        if d.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]'):
            return True  # stop waiting: the report says why
        return len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg")) >= min_charts

    try:
        wait.until(charts_drawn)
        if tab:
            buttons = [b for b in driver.find_elements(By.CSS_SELECTOR, '[role="tab"]') if b.text.strip() == tab]
            if not buttons:
                raise ValueError(f"no tab named {tab!r} on {url}")
            buttons[0].click()
            # The click reruns the app to draw the tab; let that rerun begin before settling.
            wait.until(lambda d: buttons[0].get_attribute("aria-selected") == "true")
            time.sleep(1.0)
        wait.until(_Settled(By))
    except TimeoutException:
        report = _report(driver, By)
        driver.save_screenshot(str(out_png))
        raise TimeoutError(f"{url} drew {report.charts} of {min_charts} charts within {timeout_s:.0f} s; "
                           f"errors: {report.errors}; exceptions: {report.exceptions}") from None
    # Grow the window to the page's full height so one PNG holds every chart.
    full = driver.execute_script(
        "const m = document.querySelector('[data-testid=\"stMain\"]') || document.body;"
        "return Math.max(m.scrollHeight, document.body.scrollHeight);")
    driver.set_window_size(width, min(max(height, int(full) + 120), 12000))
    time.sleep(1.0)  # plotly re-lays out charts after a resize
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out_png))
    return _report(driver, By)


class _Settled:
    """Wait condition: the script has finished a run (``stApp`` reports ``notRunning``),
    the page holds content, and the number of drawn charts held still between two polls."""

    def __init__(self, by) -> None:
        self.by, self.previous = by, -1

    def __call__(self, driver) -> bool:
        apps = driver.find_elements(self.by.CSS_SELECTOR, '[data-testid="stApp"]')
        idle = bool(apps) and apps[0].get_attribute("data-test-script-state") == "notRunning"
        content = driver.find_elements(self.by.CSS_SELECTOR, '[data-testid="stMain"] [data-testid="stHeading"]')
        count = len(driver.find_elements(self.by.CSS_SELECTOR, ".js-plotly-plot .main-svg"))
        settled = idle and bool(content) and count == self.previous
        self.previous = count
        return settled


def _report(driver, by) -> PageReport:
    exceptions = [e.text for e in driver.find_elements(by.CSS_SELECTOR, '[data-testid="stException"]')]
    text = driver.find_element(by.TAG_NAME, "body").text
    if "Traceback" in text:
        exceptions.append("the page shows a Traceback")
    errors = [e.text for e in driver.find_elements(by.CSS_SELECTOR, '[data-testid="stAlertContentError"]')]
    charts = len({id(e) for e in driver.find_elements(by.CSS_SELECTOR, ".js-plotly-plot")})
    return PageReport(charts=charts, exceptions=exceptions, errors=errors, text=text)


def screenshot(runs_dir: str | Path, out_png: str | Path, *, run: str | None = None,
               compare: list[str] | None = None, tab: str | None = None, min_charts: int = 1,
               timeout_s: float = 90.0) -> PageReport:
    """Serves ``runs_dir``, photographs the page (one run, or a comparison) into ``out_png``."""
    query = {}
    if run:
        query["run"] = run
    if compare:
        query["compare"] = ",".join(compare)
    with serve(runs_dir, timeout_s=timeout_s) as url:
        page = url + ("/?" + urllib.parse.urlencode(query) if query else "")
        return capture(page, out_png, min_charts=min_charts, tab=tab, timeout_s=timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="runs directory (holds runs/<run-id>/)")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--run", help="run id to show (default: the newest readable run)")
    parser.add_argument("--compare", help="comma-separated run ids to compare instead")
    parser.add_argument("--tab", help="tab to open before the shot, e.g. Executors")
    parser.add_argument("--min-charts", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for the page")
    args = parser.parse_args(argv)
    missing = browser_missing()
    if missing:
        print(f"cannot take a screenshot: {missing}", file=sys.stderr)
        return 2
    report = screenshot(args.runs, args.out, run=args.run, tab=args.tab, min_charts=args.min_charts,
                        compare=args.compare.split(",") if args.compare else None, timeout_s=args.timeout)
    print(f"wrote {args.out}: {report.charts} charts, {len(report.errors)} error boxes, "
          f"{len(report.exceptions)} exceptions")
    return 1 if report.exceptions else 0


if __name__ == "__main__":
    sys.exit(main())
