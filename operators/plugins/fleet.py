"""The fleet in the Airflow UI: an Airflow 3 plugin that registers a FastAPI app on the api-server
(``/trainguard/fleet``, and ``/trainguard/fleet.json`` for scripts) and adds a "Fleet" page to the UI's
navigation (an external view, shown inside the UI). Only a logged-in user of the UI sees it (the UI's
session cookie, or a bearer token, through Airflow's own ``requires_authenticated``).

The page is :func:`trainguard.operators.fleet_view.collect`: each job's state as its machines report it now next to
what the fleet database records, its revision and step, its machines and their states, its open incidents
and the rung handling them, the standby pool against its target, and the newest ETTR. Registered through
the ``airflow.plugins`` entry point of the trainguard package.
"""

from __future__ import annotations

import html
from typing import Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI
from fastapi.responses import HTMLResponse

# Airflow's components load their plugins when they start: the scheduler does before its LocalExecutor forks
# the workers that fork every task process, so the control plane's task imports are done once, here
import trainguard.operators.tasks.preload  # noqa: F401

PREFIX = "/trainguard"
REFRESH_S = 10


def _authenticated() -> Any:
    from airflow.api_fastapi.core_api.security import requires_authenticated

    return Depends(requires_authenticated())


app = FastAPI(title="trainguard fleet", description="The trainguard fleet's jobs, machines, incidents, standbys "
                                                    "and ETTR.")


def _doc() -> dict[str, Any]:
    from trainguard.operators import fleet_view
    from trainguard.operators.tasks import common

    return fleet_view.collect(common.shared_controller())  # one controller (and engine) per api-server


@app.get("/fleet.json", dependencies=[_authenticated()])
def fleet_json() -> dict[str, Any]:
    """The Fleet page's document, as JSON."""
    return _doc()


@app.get("/fleet", response_class=HTMLResponse, dependencies=[_authenticated()])
def fleet_page() -> str:
    """The Fleet page (refreshes itself every few seconds)."""
    return render(_doc())


def _pct(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1%}"


def render(doc: dict[str, Any]) -> str:
    """The document as one HTML page; every value escaped."""
    e = html.escape
    rows = []
    for j in doc["jobs"]:
        machines = ", ".join(f"{e(m['machine'])} ({e(m['state'])}, {e(str(m['job_process'] or '?'))})"
                             for m in j["machines"])
        incidents = "; ".join(f"#{i['incident']} {e(i['category'])}: {e(i['rung'])} ({e(i['state'])}, "
                              f"{i['open_s']:.0f}s)" for i in j["incidents"]) or "none"
        ettr = j["ettr"] or {}
        state = e(j["state"])
        d = j.get("degraded")
        if d:  # training on without some replicas: which, the share training, and for how long
            state += (f'<br><span class="degraded">replica(s) {e(", ".join(map(str, d["replicas"])))} out, '
                      f'{float(d["width"] or 0) * 100:.0f}% of replicas training'
                      + (f', for {float(d["for_s"]):.0f}s' if d.get("for_s") is not None else "") + "</span>")
        rows.append(
            f'<tr data-job="{e(j["job"])}"><td>{e(j["job"])}</td>'
            f'<td class="state" data-state="{e(j["state"])}"{" data-problem" if j["problem"] else ""}>{state}</td>'
            f'<td>{e(j["recorded_state"])}</td><td>{e(j["revision"])}</td>'
            f'<td>{"-" if j["step"] is None else int(j["step"])}</td><td>{machines}</td><td>{incidents}</td>'
            f'<td>{_pct(ettr.get("cumulative"))} / {_pct(ettr.get("sliding"))}</td>'
            f'<td class="problem">{e(j["problem"])}</td></tr>')
    pool = doc["pool"]
    short = f' <b class="problem">{pool["short"]} short</b>' if pool["short"] else ""
    standbys = e(", ".join(pool["standbys"])) or "none"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>trainguard fleet</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; }}
td.state[data-state="running"]:not([data-problem]) {{ color: #087f23; font-weight: bold; }}
td.state:not([data-state="running"]), td.state[data-problem] {{ color: #b00020; font-weight: bold; }}
td.state[data-state="degraded"], .degraded {{ color: #b26a00; }} .problem {{ color: #b00020; }}
</style></head><body>
<h1>trainguard fleet</h1>
<p id="pool">standby pool: {len(pool["standbys"])} of target {pool["target"]} ({standbys})
{short}; {pool["serving"]} machines serving running jobs</p>
<table id="jobs"><tr><th>job</th><th>state (machines now)</th><th>state (fleet database)</th><th>revision</th>
<th>step</th><th>machines (fleet state, job process)</th><th>open incidents (rung)</th>
<th>ETTR cumulative / sliding</th><th>problem</th></tr>
{"".join(rows) or '<tr><td colspan="9">no job</td></tr>'}
</table></body></html>"""


class TrainguardPlugin(AirflowPlugin):
    """The Fleet page in the Airflow UI's navigation, served by the api-server."""

    name = "trainguard"
    fastapi_apps = [{"app": app, "url_prefix": PREFIX, "name": "trainguard fleet"}]  # noqa: RUF012
    external_views = [{"name": "Fleet", "href": f"{PREFIX}/fleet", "destination": "nav",  # noqa: RUF012
                       "url_route": "trainguard-fleet"}]
