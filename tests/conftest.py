"""Suite-wide settings: tiny models run several times faster on one intra-op thread than on two
busy ones (server subprocesses choose their own)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
