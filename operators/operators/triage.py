"""``triage`` of ``tg_incident``: the run's first task. A run Airflow started for the ``trainguard-alerts`` asset
(each event a batch the alert watcher saw) records its batches first (:func:`trainguard.operators.tasks.guardian
.incident_of_run`) and takes the incident they opened as its own; a run started for an incident (its ``incident_id``
param: handed on, triaged again, driven again by the reconciler, by hand) claims that one. Then the ladder's first
decision (XCom ``decision``, and ``incident``) and the branch to its rung. A batch that only joined an incident
already open ends the run here: every task after this one is skipped, and the run's note says where the alerts
went."""

from __future__ import annotations

from typing import Any

from airflow.providers.standard.operators.branch import BaseBranchOperator


class TriageOperator(BaseBranchOperator):
    """Records what started the run, triages its incident, branches to the rung (see the module)."""

    def choose_branch(self, context: Any) -> str | list[str]:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import common, guardian, incident

        c = task_controller()
        ti, run = context["ti"], str(context["run_id"])
        incident_id = (context.get("params") or {}).get("incident_id")
        if incident_id:  # a run started for its incident
            conf = getattr(context.get("dag_run"), "conf", None) or {}
            c.fleet.claim_run(int(incident_id), run, first_seen_ts=conf.get("first_seen_ts"))
        else:
            events = guardian.events_of(context.get("triggering_asset_events"))
            incident_id, starts, line = guardian.incident_of_run(c, events, run=run)
            started = guardian.start_soon(starts)
            self.log.info("%s%s", line, f"; runs started for the others: {started}" if started else "")
            if incident_id is None:  # the alerts joined incidents already open: nothing more for this run
                common.note(line)
                self.skip(ti=ti, tasks=[t for t in context["task"].get_flat_relatives(upstream=False)
                                        if not t.is_teardown])  # (raises: the task ends there, a success)
                return []
        ti.xcom_push(key="incident", value=int(incident_id))
        decision = incident.triage(c, int(incident_id))
        ti.xcom_push(key="decision", value=decision)
        return incident.choose(decision)
