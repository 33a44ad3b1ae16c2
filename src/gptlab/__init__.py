"""gptlab: GPT-2 from scratch through the experiments of "Build a Large Language Model (From Scratch)"."""
