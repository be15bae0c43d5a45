"""The leaves every layer may import: the typed config (config.py) and the errors and exit codes (errors.py)."""
