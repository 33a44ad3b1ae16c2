"""The tasks layer: what the fine-tuned models are for: spam classification, instruction answers and their judge, preference tuning (DPO)."""
