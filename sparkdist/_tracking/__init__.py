"""What a run reports while it runs: the MLflow run (``mlflow_run``), the live progress display
(``progress``) and the per-launch tracker that feeds both (``tracker``)."""
