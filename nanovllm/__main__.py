"""``python -m nanovllm``: the ``nanovllm`` command, for a checkout on ``PYTHONPATH`` whose console
script is not installed (``nanovllm.entrypoints.cli`` has the commands)."""

import sys

from nanovllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
