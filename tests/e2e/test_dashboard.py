"""The live fleet page in headless Chromium against a real ``modelfleet serve``.

Requests go in over HTTP; the page must show what was sent: the worker and its
permits, the backlog of a model whose load is held up, the models resident after
the answers, the loads from storage and the load-rate panel moving. A screenshot of
the page must not be empty (set MODELFLEET_DASHBOARD_SCREENSHOT=docs/dashboard.png to
keep it for the README).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.browser import dump_dom, screenshot
from tests.procs import ROOT, serve
from tests.waiting import eventually_blocking

pytestmark = pytest.mark.timeout(240)
# The held-up load the backlog waits behind: held until the page was read (the test then
# creates slowload's release file), at most this long (the requests' default 30 s deadline
# outlasts it).
SLOW_LOAD_S = 25
HELD = 5  # requests sent to it at once, with one permit: one runs, four wait in the queue


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The serve's base URL, and the file whose creation ends slowload's held load."""
    tmp = tmp_path_factory.mktemp("dashboard")
    release = tmp / "release"
    # No cold lane: the page is read while slowload's requests wait in its own queue,
    # whose row the test reads (with the lane they would wait there, counted in the
    # totals only).
    proc, base = serve(tmp, env={"MODELFLEET_EXAMPLE_SLOWLOAD_S": str(SLOW_LOAD_S),
                                 "MODELFLEET_EXAMPLE_SLOWLOAD_RELEASE": str(release),
                                 "MODELFLEET_WORKER__PERMITS": "1",
                                 "MODELFLEET_WORKER__STATE_INTERVAL_S": "0.5",
                                 "MODELFLEET_GATEWAY__COLD_LANE_PER_MODEL": "0"})
    try:
        yield base, release
    finally:
        proc.stop()


def wait_for(base: str, check: Callable[[dict[str, Any]], bool], what: str,
             timeout_s: float = 90) -> dict[str, Any]:
    summary: dict[str, Any] = {}

    def seen() -> dict[str, Any] | None:
        nonlocal summary
        summary = httpx.get(f"{base}/v1/fleet/summary", timeout=10).json()
        return summary if check(summary) else None

    found: dict[str, Any] = eventually_blocking(
        seen, timeout_s, what=what, every_s=0.3,
        state=lambda: {k: summary.get(k) for k in ("totals", "queues")})
    return found


def queue_row(rows: list[dict[str, Any]], model: str) -> list[str]:
    (row,) = [r for r in rows if r["data"].get("model") == model]
    return list(row["cells"])


def test_the_page_shows_the_fleet_the_backlog_and_the_load_rate(
        fleet: tuple[str, Path], tmp_path: Path) -> None:
    base, release = fleet
    page = f"{base}/dashboard"

    async def send_held() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*[
                client.post(f"{base}/v1/models/slowload/infer", json={"n": i})
                for i in range(HELD)]))

    loop = asyncio.new_event_loop()
    held = loop.create_task(send_held())
    try:
        # One task runs (its model loading), the other four wait in the queue.
        loop.run_until_complete(asyncio.sleep(0))
        # All sent (parked here), one taken (its permit in use), the rest in the queue.
        waiting = loop.run_in_executor(None, wait_for, base, lambda s: any(
            q["model"] == "slowload" and q["backlog"] == HELD - 1 for q in s["queues"])
            and s["totals"]["permits_in_use"] == 1
            and s["totals"]["requests_waiting"] == HELD, "the held-up backlog")
        loop.run_until_complete(waiting)
        dom = dump_dom(page)
        assert dom.text("total-workers") == "1" and dom.text("total-ready-workers") == "1"
        assert dom.text("total-permits-in-use") == "1" and dom.text("total-permits-cap") == "1"
        assert dom.text("total-backlog") == str(HELD - 1)
        cells = queue_row(dom.rows["queues"], "slowload")
        assert cells[1] == str(HELD - 1)  # backlog
        assert cells[2] == "1"  # the worker consumes it
        assert cells[3].endswith(" s")  # oldest waiting: its age, not a dash
        (worker,) = dom.rows["workers"]
        assert worker["cells"][1] == "yes" and worker["cells"][2] == "1 / 1"
        assert "slowload" in worker["cells"][3]  # its subscriptions
        release.touch()  # the page was read: let the load end
        answers = loop.run_until_complete(held)
    finally:
        if not held.done():
            held.cancel()
            loop.run_until_complete(asyncio.gather(held, return_exceptions=True))
        loop.close()
    assert [r.status_code for r in answers] == [200] * HELD

    # Two more models, each loaded once from storage; then the page must show three
    # resident models, three loads and a load-rate point above zero.
    for model, body, ctype in (("iris", b'{"features": [5.1, 3.5, 1.4, 0.2]}',
                                "application/json"),
                               ("banner", b"hello", "text/plain")):
        for _ in range(3):
            answer = httpx.post(f"{base}/v1/models/{model}/infer", content=body,
                                headers={"content-type": ctype}, timeout=60)
            assert answer.status_code == 200, answer.text
    # The panel has caught up once its latest sample holds all three models.
    wait_for(base, lambda s: s["totals"]["resident_device"] == 3
             and s["totals"]["storage_loads"] == 3
             and s["load_rate"]["points"][-1]["fleet"]["resident_device"] == 3,
             "three resident models and three loads, in the load-rate panel too")
    dom = dump_dom(page)
    assert dom.text("total-resident-device") == "3"
    assert dom.text("total-storage-loads") == "3" and dom.text("total-promotions") == "0"
    assert dom.text("total-backlog") == "0"
    (worker,) = dom.rows["workers"]
    assert worker["cells"][4] == "3"  # device models
    assert worker["cells"][8] == "3 / 0"  # loads: storage / host
    chart = dom.attrs_by_id["chart"]
    assert int(chart.get("data-points", "0")) >= 2
    assert float(dom.text("rate-resident")) == 3
    # Every load the requests caused is in the panel's window, none counted twice, and
    # none of them a promotion.
    assert dom.text("window-loads") == "3" and dom.text("window-promotions") == "0"

    # One worker's panel (a shareable link): its own series, here the fleet's only worker.
    worker_id = worker["data"]["worker"]
    scoped = dump_dom(f"{page}?worker={worker_id}")
    assert scoped.text("window-loads") == "3" and float(scoped.text("rate-resident")) == 3

    shot = screenshot(page, tmp_path / "dashboard.png")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1000)
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50, "the screenshot is blank"
    keep = os.environ.get("MODELFLEET_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


def test_grafana_panels_query_what_a_running_serve_exports(fleet: tuple[str, Path]) -> None:
    base, _ = fleet
    exported = set()
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^(modelfleet_[a-z0-9_]+)(\{.*\})? ", line)
        if match:
            exported.add(match.group(1))
        elif line.startswith("# TYPE modelfleet_"):
            exported.add(line.split()[2])
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "modelfleet-fleet.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
            for name in re.findall(r"\bmodelfleet_[a-z0-9_]+", target["expr"])}
    # A histogram's or counter's series names add a suffix to its TYPE name.
    missing = {name for name in used if name not in exported
               and re.sub(r"_(bucket|count|sum|total)$", "", name) not in exported}
    assert not missing, f"not on a running serve's /metrics: {missing}"
