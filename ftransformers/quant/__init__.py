"""Low-bit weights: per-module quantization schemes for linear layers (layer L2)."""

from ftransformers.quant.base import (
    QuantConfig,
    QuantError,
    apply_quant_config,
    finish_quantized_load,
    quant_config_for,
)

__all__ = ["QuantConfig", "QuantError", "apply_quant_config", "finish_quantized_load", "quant_config_for"]
