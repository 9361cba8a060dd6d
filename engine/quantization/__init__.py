"""Quantized checkpoints. Each format is a module that gathers a checkpoint's stored
tensors for a linear weight (packed integers, scales, zero points) into one quantized
tensor in a canonical layout, under the weight's plain name:

- fp8.py: FP8 (e4m3) weights with per-tensor, per-channel or block scales
  (compressed-tensors' float-quantized format, Hugging Face's `fp8`), and quantizing a
  bfloat16 checkpoint to FP8 at load;
- int4.py: INT4 weight-only, with group scales and zero points (AutoAWQ's GEMM layout,
  GPTQ's with act-order, compressed-tensors' pack-quantized);
- gguf.py: GGUF's Q4_0, Q4_1 and Q8_0 blocks, as the file stores them;
- kv_cache.py: the FP8 KV cache's per-layer K and V scales (a checkpoint's calibrated
  ones, or 1), and the codes the cache holds.

A quantized tensor dequantizes to float32 (the numpy backend: the exact reference) or
to bfloat16 (the CUDA backend, for the formats its kernels do not read: all but FP8).
"""

from engine.quantization.formats import QUANTIZATION_METHODS, quantize_at_load, read_quantized

__all__ = ["QUANTIZATION_METHODS", "quantize_at_load", "read_quantized"]
