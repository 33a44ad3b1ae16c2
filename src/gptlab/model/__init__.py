"""The model layer: the book's GPT-2 (gpt.py), built by build.py with its speed paths (fast_kernels.py), LoRA, the tokenizer, generation and its KV cache, checkpoints and weight conversion."""
