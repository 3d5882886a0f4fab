# The control plane: Apache Airflow 3.3.2 with trainguard's DAGs, operators and pinned dependencies.
# One image for the api-server, scheduler, dag-processor, triggerer (and Celery workers).
#
#   docker build -f docker/airflow.Dockerfile -t trainguard-airflow .
FROM apache/airflow:3.3.2-python3.11

USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-client \
 && rm -rf /var/lib/apt/lists/*
USER airflow

WORKDIR /opt/trainguard
COPY --chown=airflow:root constraints.txt pyproject.toml setup.py README.md ./
COPY --chown=airflow:root trainguard ./trainguard
COPY --chown=airflow:root node_tools ./node_tools
COPY --chown=airflow:root checkpoint ./checkpoint
COPY --chown=airflow:root operators ./operators
COPY --chown=airflow:root dags ./dags
COPY --chown=airflow:root docker/provision.py ./docker/provision.py
# the control plane's side (trainguard[control]): Airflow's providers, the fleet database's drivers, the policy's
# libraries; no torch (the control plane runs no training) and no test tools (requirements-dev.txt)
RUN pip install --no-cache-dir "apache-airflow==3.3.2" ".[control]" -c constraints.txt

ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/trainguard/dags \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    PYTHONPATH=/opt/trainguard
WORKDIR /opt/airflow
