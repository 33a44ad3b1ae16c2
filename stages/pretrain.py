"""Stage `pretrain`: train GPT-2 from random weights on The Verdict (chapter 5)."""

from gptlab.stages import stage_main
from gptlab.stages.pretrain import run

if __name__ == "__main__":
    stage_main(run, __doc__)
