"""The checkpointer's fixed delays, in one place (tests change them here)."""

#: how long a step waits for the saver process to lay out buffers for a new state shape (once per shape)
CONFIGURE_WAIT_S = 10.0
COPY_LATEST_S = 0.25  # with copy_at_idle: the soonest the copier copies without waiting for host_idle
COMMIT_IDLE_S = 2.0  # the longest a rank waits for a step of its own to report before the next commit round
RETAIN_EVERY_S = 5.0  # retention runs after each commit, and at least this often without one
EMPTY_STEP_S = 60.0  # a step folder empty this long holds no copy being written: retention removes it
