"""The adapters between PyTorch, the CUDA driver and graphsan's pure core: the hooks on
`torch.cuda.CUDAGraph`, the memory watches (the caching allocator's events, or the driver's),
the walk of a captured graph, the compiled tracker library, the start-up probe, and the
program's phase and step (`context`)."""
