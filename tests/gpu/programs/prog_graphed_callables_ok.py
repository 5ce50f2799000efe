"""Make_graphed_callables on a small model, then train/eval/train done right: no finding."""

from _prelude import *  # noqa: F403

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)
).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 64, device="cuda", requires_grad=True)
gm = torch.cuda.make_graphed_callables(model, (x,))
losses = []
for it in range(6):
    if it == 3:
        model.eval()
        with torch.no_grad():
            model(torch.randn(32, 64, device="cuda"))
        model.train()
        torch.cuda.empty_cache()
    xb = torch.randn(32, 64, device="cuda", requires_grad=True)
    loss = gm(xb).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
out["losses_finite"] = all(loss == loss for loss in losses)
out["healthy"] = healthy()
finish()
