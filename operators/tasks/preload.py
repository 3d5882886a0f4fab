"""What every control-plane task process imports, loaded once ahead of the tasks.

Imported by the trainguard plugin (:mod:`trainguard.operators.plugins.fleet`), which every Airflow component loads
when it starts. The scheduler loads it before its LocalExecutor forks the workers that fork each task
process, so a task starts with the task runner, the fleet database's models, paramiko and the SSH hooks
already in memory instead of importing them: 0.1-0.2 s of CPU per task on an idle machine, several times
that beside a training job on the same cores. An incident runs about ten tasks, four of them while the job
is down. Importing this module does nothing else: it reads no settings and opens no connection. It names only
public modules: Airflow's task runner comes with them (through ``airflow.sdk``), and its supervisor is the
worker's own, loaded before any task.
"""

from __future__ import annotations

import paramiko  # noqa: F401  (the SSH client the tasks' transport imports where it connects)

import trainguard.operators.hooks.fleet
import trainguard.operators.hooks.node  # noqa: F401
from trainguard.operators.tasks import common, incident, rungs  # noqa: F401
