"""The pipeline layer: params.yaml, what every stage script shares, and the DVC command wrapper."""
