"""Running and launching: one run's phases (train: check, build, fit, polish, summarise), its
start-up checks and plan (plan, startup, preflight for ``--check``), the DeepSpeed JSON read once
(ds_config), the run directory and resume compatibility (rundir, compat, outcome), what a run is
built from (components), and the job launcher with its hostfiles (launch, hostfile) and the polish
command (polish). The top room: only the entry points (dstrain/main.py, __main__.py, launch.py,
polish.py) import it."""
