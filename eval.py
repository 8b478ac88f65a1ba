"""Evaluate calibrated tables: calibration metrics and a replay of serving policies.

    python eval.py                                   # default tables on the sample banks' test split
    python eval.py data.test=[PATH] tables=DIR out_dir=OUT cost=measured

Writes OUT/metrics.json, OUT/report.md, OUT/*.png, OUT/config.yaml and OUT/eval.log as one unit
(see calib/evaluate/README.md); an OUT holding an earlier report needs overwrite=true. Tables that do
not fit a bank (target, drafter, depth, n-gram features) are refused; a bank training never saw is
evaluated whole, a training bank on its held-out prompts.
"""

import hydra
from omegaconf import DictConfig

import calib  # noqa: F401 - registers the resolvers conf/ uses (--help's config groups)


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from calib.evaluate.run import run  # after parsing: --help answers without torch

    run(cfg)


if __name__ == "__main__":
    main()
