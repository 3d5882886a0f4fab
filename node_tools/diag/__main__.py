"""``python -m trainguard.node_tools.diag --worker ARGS.json``."""

import sys

from trainguard.node_tools.diag.worker import worker_main

sys.exit(worker_main(sys.argv[1:]))
