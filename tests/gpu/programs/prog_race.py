"""Two graphs replayed on two streams. Graph A is a long chain over scratch memory; graph B,
captured after it into the same pool (RACE_POOL=same) or into its own (separate), carves its
output from A's freed scratch. RACE_ORDER says what orders B after A: nothing, wait_stream, an
event waited for, or the host waiting. Each round replays A on one stream and B on the other,
then checks A's result against eager."""

from _prelude import *  # noqa: F403

order = os.environ.get("RACE_ORDER", "none")
shared = os.environ.get("RACE_POOL", "same") == "same"
torch.manual_seed(0)
x = torch.randn(1 << 24, device="cuda")


def chain():
    t = x
    for _ in range(60):
        t = t * 0.999 + 0.001
    return t.sum()


def doubled():
    return x * 2.0


with torch.no_grad():
    want = chain().item()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            chain(), doubled()
    torch.cuda.current_stream().wait_stream(s)
    pool = torch.cuda.graph_pool_handle()
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga, pool=pool):
        total = chain()
    with torch.cuda.graph(gb, pool=pool if shared else None):
        twice = doubled()
first, second, main = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.current_stream()
rounds, wrong = [], 0
for _ in range(5):
    first.wait_stream(main)
    second.wait_stream(main)
    with torch.cuda.stream(first):
        ga.replay()
    if order == "wait_stream":
        second.wait_stream(first)
    elif order == "event":
        done = torch.cuda.Event()
        done.record(first)
        done.wait(second)
    elif order == "host":
        first.synchronize()
    with torch.cuda.stream(second):
        try:
            gb.replay()
            rounds.append("replayed")
        except graphsan.StaleMemoryError as err:
            out["error_text"] = str(err)
            out["error_kinds"] = [f.kind for f in err.findings]
            rounds.append("raised")
    main.wait_stream(first)
    main.wait_stream(second)
    torch.cuda.synchronize()
    wrong += abs(total.item() - want) > 1e-3 * abs(want)
out["rounds"] = rounds
out["wrong_rounds"] = wrong
out["healthy"] = healthy()
finish()
