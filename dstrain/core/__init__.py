"""The ground floor: what every other room uses and that knows nothing of training. Errors and exit
statuses (errors), atomic and private files (files), the git SHA and versions a result records
(provenance), ranks and collectives (dist), typed JSON settings (jsonspec), checkpoint loading
that runs no code (safe_load), the loop's event protocol (hooks), the import guard that keeps
DeepSpeed's autotuner from loading MLflow in every process (import_guard), the log lines' set-up
(logs), and how a command's process exits (process)."""
