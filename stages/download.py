"""Fetch every external input params.yaml pins (data.sources) into data.raw_dir, verified by sha256.

Offline: set GPTLAB_MIRROR to a folder of the pinned files (`gptlab mirror DIR` writes one).
"""

from gptlab.stages import stage_main
from gptlab.stages.download import run

if __name__ == "__main__":
    stage_main(run, __doc__)
