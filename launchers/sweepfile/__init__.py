"""The sweep file, validated: schema.py (the dataclasses), loading.py (`load_sweep`), overrides.py
(`key=value` on the command line), keys.py (dotted run-config keys), search_space.py (Optuna params).
Nothing here writes anything or imports launchers.run."""
