"""`sweep run`, `status` and `cancel`: context.py (the run-state object shared by the driver, the loop
and the search), driver.py, loop.py, search.py, jobs.py (what runs inside a job), state.py (the sweep
state file and the driver lock), status.py, cancel.py, progress.py."""
