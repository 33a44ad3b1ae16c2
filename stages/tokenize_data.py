"""Stage `tokenize`: split, encode and pad The Verdict, the SMS spam collection and the instruction data.

(Named tokenize_data.py, not tokenize.py: a script's folder goes first on the
import path, and a stages/tokenize.py would shadow the standard library's.)
"""

from gptlab.stages import stage_main
from gptlab.stages.tokenize import run

if __name__ == "__main__":
    stage_main(run, __doc__)
