"""The training layer: the one training loop of all the training stages, its losses, data order, resume and devices."""
