"""The tracking layer: MLflow runs, tags and metrics, lineage, and the logged and registered models."""
