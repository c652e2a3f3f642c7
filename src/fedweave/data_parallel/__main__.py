"""``python -m fedweave.data_parallel CONFIG [key=value ...] [--run-dir DIR]``: one worker of a
torchrun job (what ``fedweave worker`` does; see :mod:`fedweave.data_parallel.torchrun`)."""

import sys

from fedweave.cli import main

sys.exit(main(["worker", *sys.argv[1:]]))
