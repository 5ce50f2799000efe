"""One run of the lab's step in a microbatch order (scripts/investigations.sh schedules):
`RUN_SCHEDULE CAPTURE_SCHEDULE IN_FLIGHT MICROBATCHES eager|off|record [reuse]` (reuse: TE's
graph buffer reuse, `--reuse-graph-buffers`); prints one RESULT line
with the losses and, under record, the kinds graphsan found and its first finding."""

import collections
import sys

import graphsan
from graphsan.command_line import write_result
from graphsan.lab.train import TrainConfig, train
from graphsan.report import one_line

run_s, cap_s, in_flight, microbatches, mode = sys.argv[1:6]
reuse = sys.argv[6:7] == ["reuse"]
cfg = dict(
    preset="tiny",
    quiet=True,
    device="cuda",
    train_iters=6,
    seq_length=64,
    micro_batch_size=1,
    global_batch_size=int(microbatches),
    cuda_graph_warmup_steps=2,
    precision_config="mxfp8-all",
    capture_grads=(),
    microbatch_schedule=run_s,
    microbatches_in_flight=int(in_flight),
)
if mode != "eager":
    cfg.update(
        cuda_graph_modules=("attn", "mamba", "moe_router", "moe_preprocess", "mlp"),
        capture_schedule=cap_s,
        reuse_graph_buffers=reuse,
    )
out = {}
if mode == "record":
    with graphsan.watch(policy="record") as san:
        out["losses"] = train(TrainConfig(**cfg)).losses
    out["kinds"] = dict(collections.Counter(f.kind for f in san.findings))
    out["first"] = [one_line(f)[:400] for f in san.findings[:2]]
else:
    out["losses"] = train(TrainConfig(**cfg)).losses
out["losses"] = [round(x, 5) for x in out["losses"]]
write_result(out)
