"""A tensor allocated eagerly into a graph's pool: the graph's scratch was freed inside the
capture, so the pool hands that memory to the eager tensor, and the next replay writes its
scratch over the tensor the caller still holds. Once the tensor is gone, replays are quiet."""

from _prelude import *  # noqa: F403

n = 1 << 20  # a large block: the pool splits one segment, so the eager tensor lands at its start
pool = torch.cuda.MemPool()
x = torch.randn(n, device="cuda")
g = torch.cuda.CUDAGraph()


scratch_at = []


def step(v):
    scratch = v * 3  # freed inside the capture: the graph's own temporary
    scratch_at.append(scratch.data_ptr())
    return scratch.sin()[:16].clone()  # a small output, from the pool's other size class


s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    step(x)  # kernels load outside the capture
    g.capture_begin(pool=pool.id)
    y = step(x)
    g.capture_end()
    with torch.cuda.use_mem_pool(pool):
        kept = torch.full((n,), 7.0, device="cuda")
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
expected_y = step(x).cpu()
# whether the pool handed the graph's scratch to the eager tensor (the hazard's premise)
out["recarved"] = kept.data_ptr() == scratch_at[1]
out["addresses"] = {"scratch": scratch_at[1], "kept": kept.data_ptr(), "y": y.data_ptr()}

out["first"] = replay_guarded(g)
out["kept_intact"] = bool(torch.equal(kept.cpu(), torch.full((n,), 7.0)))
del kept
out["after_del"] = [replay_guarded(g) for _ in range(2)]
out["y_correct"] = bool(torch.equal(y.cpu(), expected_y))
out["healthy"] = healthy()
finish()
