"""Quantised linear layers (int8, AWQ) that the engine's model can swap in, and their tools.

pack: 4-bit group quantisation and AutoAWQ packing · layers: Int4Linear, Int8WOLinear, bitsandbytes
int8 · kernels: pagechat's int8, int4 and float matmuls (kernels.cpp), built on first use ·
head: the LM head's formats · loaders: --quant / quantization_config -> LinearLoader · awq: the AWQ
search for one block · checkpoint: `quantize` · evaluate: perplexity and greedy agreement · bench:
`bench-quant`.
"""
