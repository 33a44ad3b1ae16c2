"""The training layer: the one training loop of all three training stages, its losses, data order, resume and devices."""
