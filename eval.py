"""Evaluate calibrated tables: calibration metrics and a replay of serving policies.

    python eval.py                                   # default tables on the sample banks' test split
    python eval.py data.test=[PATH] tables=DIR out_dir=OUT cost=measured

Writes OUT/metrics.json, OUT/report.md and OUT/*.png (see calib/evaluate/README.md).
"""

import hydra
from omegaconf import DictConfig

from calib.evaluate.run import run


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
