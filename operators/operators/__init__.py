"""trainguard's Airflow operators: the rungs that run as operators of their own (the fail-slow vote, the
silent-corruption replay and its phases) and the incident's close. They defer to the triggers of
:mod:`trainguard.operators.triggers` while they wait; the sensors that only wait are in
:mod:`trainguard.operators.sensors`."""
