"""The lab: a small Nemotron-H-style hybrid trained with per-module NVFP4 / MXFP8 / BF16 recipes and
per-module CUDA graphs, used to reproduce Transformer Engine #3316 and to train through it.

The lab may import `graphsan`; nothing in the sanitizer imports the lab.
"""
