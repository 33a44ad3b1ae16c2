"""The serving layer: the trained checkpoints as the MLflow pyfunc models that `mlflow models serve` runs."""
