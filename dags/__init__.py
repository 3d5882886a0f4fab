"""trainguard's workflow files (wiring only), installed as ``trainguard.dags``: ``trainguard airflow bundles``
names this folder as a local bundle for the Airflow that runs them."""
