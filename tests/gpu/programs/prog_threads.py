"""Threads capturing, replaying and freeing at once. THREADS_N workers, each on its own stream,
capture a graph over a fresh input (thread-local capture mode, labelled `t<k>-r<round>`), and
replay it; in about a quarter of the rounds the input is freed after the capture and its memory
handed to another tensor first (a stale replay). A churn thread allocates and frees eager
tensors meanwhile. Reports per round what ran and what it computed, and whether every thread
ended within THREADS_LIMIT seconds."""

import contextlib
import random
import threading
import time

from _prelude import *  # noqa: F403

N = int(os.environ.get("THREADS_N", "6"))
ROUNDS = int(os.environ.get("THREADS_ROUNDS", "25"))
LIMIT = float(os.environ.get("THREADS_LIMIT", "120"))

# one capture on this thread first: the start-up probe runs before the workers begin
warm_x = torch.ones(256, device="cuda")
warm = torch.cuda.CUDAGraph()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    warm_x + 1
    warm.capture_begin()
    warm_y = warm_x + 1
    warm.capture_end()
warm.replay()
torch.cuda.synchronize()

lock = threading.Lock()
rounds: list[dict] = []
errors: list[str] = []
stop = threading.Event()
start = threading.Barrier(N + 1)


def step(x):
    return ((x * 2 + 1) * 3).sum()


def worker(k: int) -> None:
    rng = random.Random(k)
    stream = torch.cuda.Stream()
    draws = torch.Generator(device="cuda").manual_seed(k)  # not the one every capture registers
    try:
        start.wait(60)
        with torch.cuda.stream(stream):
            for r in range(ROUNDS):
                n = rng.choice([1024, 1 << 16, 1 << 20])
                x = torch.randn(n, device="cuda", generator=draws)
                want = float(step(x))  # also loads the kernels outside the capture
                g = torch.cuda.CUDAGraph()
                with graphsan.label(f"t{k}-r{r}") if san else contextlib.nullcontext():
                    g.capture_begin(capture_error_mode="thread_local")
                    y = step(x)
                    g.capture_end()
                stale = rng.random() < 0.25
                if stale:
                    del x
                    other = torch.full((n,), 7.0, device="cuda")  # noqa: F841
                try:
                    g.replay()
                    stream.synchronize()
                    got, outcome = float(y), "ran"
                except graphsan.StaleMemoryError as err:
                    got, outcome = None, "raised"
                    if not all(f.graph.label == f"t{k}-r{r}" for f in err.findings):
                        errors.append(
                            f"t{k}-r{r}: raised for {[f.graph.label for f in err.findings]}"
                        )
                right = got is not None and abs(got - want) <= 1e-3 * max(1.0, abs(want))
                with lock:
                    rounds.append(
                        {"label": f"t{k}-r{r}", "stale": stale, "outcome": outcome, "right": right}
                    )
                del g
    except Exception as err:  # noqa: BLE001
        errors.append(f"t{k}: {type(err).__name__}: {err}"[:300])


def churn() -> None:
    side = torch.cuda.Stream()
    rng = random.Random(99)
    held = []
    with torch.cuda.stream(side):
        while not stop.is_set():
            held.append(torch.empty(rng.choice([512, 1 << 18, 1 << 21]), device="cuda"))
            if len(held) > 20:
                held.pop(rng.randrange(len(held)))
            time.sleep(0.001)


workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(N)]
churner = threading.Thread(target=churn, daemon=True)
for t in workers:
    t.start()
churner.start()
start.wait(60)
t0 = time.monotonic()
for t in workers:
    t.join(max(0.0, LIMIT - (time.monotonic() - t0)))
stop.set()
churner.join(10)
alive = sum(t.is_alive() for t in workers + [churner])
out["alive"] = alive
out["seconds"] = round(time.monotonic() - t0, 1)
out["rounds"] = rounds
out["errors"] = errors
torch.cuda.synchronize()
out["healthy"] = healthy()
finish()
if alive:
    os._exit(3)  # a thread that never ends would hold the interpreter's exit
