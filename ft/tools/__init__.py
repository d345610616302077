"""Offline tools, apart from the serving path: the demo checkpoint, synthetic flagship weights, and
the ModelOpt-exact NVFP4 quantizer (`ft quantize`)."""
