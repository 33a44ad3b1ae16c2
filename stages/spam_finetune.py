"""Stage `spam-finetune`: fine-tune GPT-2 as an SMS spam classifier and score it (chapter 6)."""

from gptlab.stages import stage_main
from gptlab.stages.spam_finetune import run

if __name__ == "__main__":
    stage_main(run, __doc__)
