"""Prefect flows: train and retrain.

Prefect's server sends usage analytics by default; on an offline machine every command then prints a
telemetry error. Off unless the environment says otherwise (set before Prefect is imported).
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
