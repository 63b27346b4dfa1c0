"""Serve the dashboard on loopback and load it in headless Chromium (CI keeps the screenshots).

Needs ``apt-get install -y chromium chromium-driver``; skipped with the reason otherwise.
Screenshots land in ``artifacts/`` (gitignored) for CI to keep.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llamarl.dashboard import screenshot
from dashboard_fixtures import make_runs_root

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(screenshot.browser_missing() is not None,
                       reason=f"no headless browser: {screenshot.browser_missing()}"),
]


def test_dashboard_renders_in_chromium(tmp_path):
    root = make_runs_root(tmp_path / "runs")
    ARTIFACTS.mkdir(exist_ok=True)
    with (screenshot.serve(root, log_path=ARTIFACTS / "dashboard-streamlit.log") as url,
          screenshot.browser() as driver):
        page = screenshot.capture(f"{url}/?run=async-run", ARTIFACTS / "dashboard.png", min_charts=4,
                                  driver=driver)
        assert not page.exceptions, page.exceptions
        assert not page.errors, page.errors
        assert page.charts >= 4
        assert "async-run" in page.text and "generated tokens/s" in page.text

        # The busy/idle timeline (generation overlapping training) lives on the Executors tab.
        page = screenshot.capture(f"{url}/?run=async-run", ARTIFACTS / "dashboard-executors.png",
                                  tab="Executors", min_charts=3, driver=driver)
        assert not page.exceptions, page.exceptions
        assert "Executor timeline" in page.text

        page = screenshot.capture(f"{url}/?run=async-run", ARTIFACTS / "dashboard-security.png",
                                  tab="Security", min_charts=1, driver=driver)
        assert not page.exceptions, page.exceptions
        assert "security/rejected_frames/bad_tag" in page.text and "Refused so far" in page.text

        page = screenshot.capture(f"{url}/?compare=sync-run,async-run", ARTIFACTS / "dashboard-compare.png",
                                  min_charts=8, driver=driver)
        assert not page.exceptions, page.exceptions
        assert page.charts >= 8

        page = screenshot.capture(f"{url}/?run=corrupt-run", ARTIFACTS / "dashboard-corrupt.png",
                                  min_charts=0, driver=driver)
        assert not page.exceptions, page.exceptions
        assert any("not a readable SQLite database" in e for e in page.errors), page.errors
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
