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
COPY --chown=airflow:root requirements.txt constraints.txt pyproject.toml setup.py README.md ./
# the control plane runs no training: the CPU build of torch is enough for its imports
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-cache-dir "apache-airflow==3.3.2" -r requirements.txt -c constraints.txt
COPY --chown=airflow:root trainguard ./trainguard
COPY --chown=airflow:root node_tools ./node_tools
COPY --chown=airflow:root checkpoint ./checkpoint
COPY --chown=airflow:root operators ./operators
COPY --chown=airflow:root dags ./dags
COPY --chown=airflow:root docker/provision.py ./docker/provision.py
RUN pip install --no-cache-dir --no-deps .

ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/trainguard/dags \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    PYTHONPATH=/opt/trainguard
WORKDIR /opt/airflow
