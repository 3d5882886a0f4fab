"""What every control-plane task process imports, loaded once ahead of the tasks.

Imported by the trainguard plugin (:mod:`trainguard.operators.plugins.fleet`), which every Airflow component loads
when it starts. The scheduler loads it before its LocalExecutor forks the workers that fork each task
process, so a task starts with the task runner, the fleet database's models, paramiko, the SSH hooks and
what the DAG files import (each task process parses its DAG file again: the operators, sensors and
triggers they build, and Airflow's ``@task`` operator) already in memory instead of importing them:
0.1-0.2 s of CPU per task on an idle machine, several times that beside a training job on the same cores.
An incident runs about ten tasks, four of them while the job is down. Importing this module does nothing
else: it reads no settings and opens no connection. It names only public modules: Airflow's task runner
comes with them (through ``airflow.sdk``), and its supervisor is the worker's own, loaded before any task.
"""

from __future__ import annotations

import airflow.providers.standard.decorators.python  # noqa: F401  (what ``@task`` builds each task with)
import paramiko  # noqa: F401  (the SSH client the tasks' transport imports where it connects)
from airflow.sdk import BaseSensorOperator, Connection, task  # noqa: F401

import trainguard.operators.hooks.fleet
import trainguard.operators.hooks.node  # noqa: F401
from trainguard.operators.operators import close, replay, triage, vote  # noqa: F401  (the DAG files' own)
from trainguard.operators.sensors import resume  # noqa: F401
from trainguard.operators.tasks import common, incident, rungs  # noqa: F401
from trainguard.operators.triggers import alerts, reconcile  # noqa: F401
from trainguard.operators.utils import forms, schedules  # noqa: F401
