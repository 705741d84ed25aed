"""`sweep run`, `status` and `cancel`: session.py (the state one `sweep run` shares with the loop and
its cell sources), loop.py, cell_sources.py (a grid's cells) and search.py (Optuna trials), driver.py,
cell_facts.py (pure helpers about a cell), jobs.py (what runs inside a job), sweep_report.py (the report
and the count of finished cells), state.py (the sweep state file and the driver lock), status.py,
cancel.py, progress.py."""
