"""Torch.compile's CUDA graph trees: correct use must give no finding."""

from _prelude import *  # noqa: F403

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step_fn = torch.compile(model, mode="reduce-overhead")
ok = True
for it in range(8):
    x = torch.randn(64, 256, device="cuda")
    loss = step_fn(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ok = ok and bool(torch.isfinite(loss).item())
    if it == 4:
        model.eval()
        with torch.no_grad():
            ref = model(x)
            ok = ok and bool(torch.allclose(step_fn(x), ref, atol=1e-4))
        model.train()
out["ok"] = ok
out["healthy"] = healthy()
finish()
