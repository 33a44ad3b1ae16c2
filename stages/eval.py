"""Stage `eval`: loss, perplexity and samples of the pretrained model (chapter 5)."""

from gptlab.stages import stage_main
from gptlab.stages.eval import run

if __name__ == "__main__":
    stage_main(run, __doc__)
