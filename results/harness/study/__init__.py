"""results/harness/accuracy_study.py's parts: the rows it trains (``rows``), the numbers it reads from their
runs (``stats``), the code the runs ran (``commits``) and the report it writes (``report``); also read
by results/harness/ablation.py and bench/epochs_tuned.py."""
