"""`ftransformers quantize`: write a quantized copy of a Hugging Face checkpoint in the formats vLLM and
SGLang read (docs/quantization.md).

    ftransformers quantize --model-path IN --output OUT --method {awq,gptq,rtn-int4,mxfp4,nvfp4,fp8,w8a8-int8}
        [--group-size N] [--symmetric] [--desc-act] [--calib-data FILE] [--calib-tokens N]
        [--ignore MODULE ...] [--cpu-weight-path DIR]

  cli.py          flags, one-line errors
  checkpoint.py   which modules (the loader's rule on a meta model), streaming, sharding, config
  writers.py      per method: rounding into a QuantizedWeight and the on-disk tensors + config
  calibration.py  layer-by-layer runs of the transformers model for AWQ and GPTQ
  awq.py, gptq.py, smoothquant.py   the calibrated methods
  cpu_weights.py  --cpu-weight-path: INT4 per-channel experts for the CPU hybrid, and their reader
"""

from __future__ import annotations

from ftransformers.entrypoints.quantize.checkpoint import quantize_checkpoint
from ftransformers.entrypoints.quantize.cli import main
from ftransformers.entrypoints.quantize.smoothquant import smooth, smoothquant_scales
from ftransformers.entrypoints.quantize.writers import METHOD_SPECS

METHODS = METHOD_SPECS

__all__ = ["METHODS", "METHOD_SPECS", "main", "quantize_checkpoint", "smooth", "smoothquant_scales"]
