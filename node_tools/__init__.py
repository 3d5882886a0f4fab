"""trainguard data plane: what runs on every machine of a training job.

The ``tg-node`` command line, the in-job monitor hook that training ranks call,
the topology model of a job (tensor, pipeline and data parallel groups), the
machine inventory, the transports that reach machines, and the emulated cluster
used by the demo and the tests.

Nothing here imports Airflow; torch and pynvml are imported only where needed.
"""

__version__ = "0.1.0"
