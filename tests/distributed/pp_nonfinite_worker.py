"""Worker for test_pipeline.py: a NaN in one stage's weight makes every pipeline rank skip the step.

Run under torchrun with pp=2; each rank writes `rank{r}.json` into the dump folder:
whether its own weights stayed unchanged and how many non-finite steps it counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainer.config import load_job_config
from trainer.distributed import destroy_distributed
from trainer.train import build_trainer


def main(argv: list[str]) -> None:
    cfg = load_job_config(argv)
    trainer = build_trainer(cfg)
    try:
        model = trainer.model
        if "3" in model.layers:  # only the last stage's rank holds block 3
            with torch.no_grad():
                model.layers["3"].mlp.up_proj.weight.to_local()[0, 0] = float("nan")
        before = {k: v.to_local().clone() for k, v in model.named_parameters() if k != "layers.3.mlp.up_proj.weight"}
        trainer.run()
        unchanged = all(torch.equal(v, dict(model.named_parameters())[k].to_local()) for k, v in before.items())
        rank = torch.distributed.get_rank()
        (Path(cfg.job.dump_folder) / f"rank{rank}.json").write_text(json.dumps({
            "unchanged": unchanged, "num_nonfinite": trainer.metrics.num_nonfinite,
            "has_block3": "3" in model.layers,
        }))
    finally:
        trainer.close()
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
