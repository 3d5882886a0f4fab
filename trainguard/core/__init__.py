"""The ground floor both sides of trainguard stand on: the machines' side (the node tools, the checkpoint
library, the training faces) and the control plane.

It imports nothing else of trainguard, and needs only the standard library and psutil:

``trainguard.core.errors``
    One-line errors with documented exit codes, and the words other parts match on.
``trainguard.core.topology``
    A job's parallel layout: which rank sits where, and with whom.
``trainguard.core.files``
    The one way a file someone may be reading is replaced (atomically).
``trainguard.core.procs``
    Processes found and ended by what they are, not by what we remember of them.
"""
