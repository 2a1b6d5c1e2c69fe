"""`python -m ftransformers.bench` = `ftransformers bench`."""

from __future__ import annotations

import sys

from ftransformers.bench.cli import main

sys.exit(main())
