"""Run by tests under `python -m torch.distributed.run`: train the configuration given as JSON
(argv[1]) on every rank and write each rank's losses to argv[2].rank{N}.json."""

from __future__ import annotations

import json
import os
import sys

from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.trainer import train


def main() -> None:
    cfg = TrainConfig(**json.loads(sys.argv[1]))
    result = train(cfg)
    out = {
        "losses": result.losses,
        "mtp_losses": result.mtp_losses,
        "grad_norms": result.grad_norms,
        "eval_losses": result.eval_losses,
        "main_grads": {k: v.tolist() for k, v in (result.main_grads or [{}])[-1].items()},
    }
    with open(f"{sys.argv[2]}.rank{os.environ['RANK']}.json", "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
