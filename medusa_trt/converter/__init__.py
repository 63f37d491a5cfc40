"""medusa-convert: Hugging Face base + Medusa heads -> merged TensorRT-LLM checkpoint."""

from medusa_trt.converter.hf_base import ConvertError
from medusa_trt.converter.merge import ConvertSummary, convert
from medusa_trt.converter.quantize import QuantOptions

__all__ = ["ConvertError", "ConvertSummary", "QuantOptions", "convert"]
