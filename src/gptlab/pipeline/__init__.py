"""The pipeline layer: what the stage scripts (stages/*.py, one per DVC stage) share: params.yaml, a training stage's run and outputs, plots, the DVC wrapper."""
