"""The training loop and its state: the Trainer (trainer), evaluation (evaluate), logs and
TensorBoard (monitor), checkpoints (checkpoint), stop signals, divergence and rank records (fault),
the stall watchdog (watchdog), and MLPerf's log (mlperf, a hook on the loop). Imports the rooms
below it: core, settings, techniques, data."""
