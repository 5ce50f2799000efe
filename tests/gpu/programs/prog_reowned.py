"""Freed, then the block handed to a new tensor: silent corruption without graphsan."""

from _prelude import *  # noqa: F403

x = torch.randn(1 << 20, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x * 2
x_ptr = x.data_ptr()
del x
z = torch.full((1 << 20,), 7.0, device="cuda")
out["same_block"] = z.data_ptr() == x_ptr
out["replay"] = replay_guarded(g)
out["y_is_14"] = bool((y == 14).all().item()) if out["replay"] == "replayed" else None
out["healthy"] = healthy()
finish()
