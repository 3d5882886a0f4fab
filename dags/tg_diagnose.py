"""tg_diagnose: the stop-time diagnosis hierarchy on chosen machines, by hand from the UI (L1 quick health,
L2 compute + memory + intra-machine collective, L3 collective with neighbours). With "evict", machines that
fail are replaced by standbys and an incident records it."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task


@dag(dag_id="tg_diagnose", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["trainguard"],
     doc_md=__doc__, params={
         "job": Param("demo", type="string", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
                      description="the job whose machines are diagnosed"),
         "machines": Param([], type="array", items={"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"},
                           description="machine names; empty = every machine of the job"),
         "level": Param(2, type="integer", enum=[1, 2, 3], description="run levels 1 .. this"),
         "evict": Param(False, type="boolean", description="replace machines that fail with standbys"),
     })
def tg_diagnose():
    @task
    def diagnose(params: dict | None = None) -> dict:
        from operators.airflow import steps

        return steps.diagnose_by_hand(params["job"], list(params["machines"]), int(params["level"]),
                                      bool(params["evict"]))

    diagnose()


tg_diagnose()
