"""Stage `instruct-finetune`: instruction-tune GPT-2 (chapter 7), answer the test set and score the answers."""

from gptlab.stages import stage_main
from gptlab.stages.instruct_finetune import run

if __name__ == "__main__":
    stage_main(run, __doc__)
