from __future__ import annotations

import sys

from ftransformers.entrypoints.cli import main

sys.exit(main())
