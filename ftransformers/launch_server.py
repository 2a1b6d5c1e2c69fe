"""`python -m ftransformers.launch_server [flags]`: the same as `ftransformers serve [flags]`."""

from __future__ import annotations

import sys

from ftransformers.entrypoints.cli import serve

if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:], prog="python -m ftransformers.launch_server"))
