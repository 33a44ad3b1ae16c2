"""The model layer: the book's GPT-2 (gpt.py) and its speed paths (fast_kernels.py), LoRA, the tokenizer, generation, checkpoints and weight conversion."""
