"""Control-plane policy as plain Python (no Airflow): triage and the decision ladder, the circuit
breaker, runtime (stack) analysis, dual-phase replay planning, the ETTR ledger."""
