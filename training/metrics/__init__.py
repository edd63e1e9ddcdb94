"""Metrics where people look, written beside the run: TensorBoard event files and the progress bar (log.py), an MLflow
run (mlflow_log.py). The loops (training/unit/) call ``metrics_for``; nothing here reads checkpoints or trains."""
