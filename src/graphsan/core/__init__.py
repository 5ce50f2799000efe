"""The pure analysis: graph references x memory events -> findings. No CUDA, no torch.

`records` (the data), `memory_map` (the allocator's segments: snapshot map and incremental view),
`scan` (addresses in node arguments), `tracker` (watched blocks, judgement).
"""
