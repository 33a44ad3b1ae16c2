"""Stage `load-gpt2`: OpenAI's GPT-2 weights (or our own pretrained model) as the fine-tunes' base models."""

from gptlab.stages import stage_main
from gptlab.stages.load_gpt2 import run

if __name__ == "__main__":
    stage_main(run, __doc__)
