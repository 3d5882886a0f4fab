"""trainguard control plane: Airflow hooks, operators, sensors and triggers, and the
plain-Python policy they call (triage, diagnosis ladder, stack clustering, standby
sizing, fleet DB, ETTR ledger). Policy modules import no Airflow, so they are
unit-tested without it and reused by the scale simulator.

Importing this package imports nothing heavy.
"""
