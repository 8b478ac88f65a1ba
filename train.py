"""Fit calibrators on banks and export tables: ``python train.py [overrides]`` (conf/train.yaml).

    python train.py                                   # sample banks -> runs/train/default
    python train.py data.train=[PATH] out_dir=DIR     # an out_dir holding tables needs overwrite=true

Everything a run writes (tables, summary.txt, reliability_test.png, config.yaml, train.log, the
tracker's files) lands in out_dir as one unit when the run succeeds; Hydra itself writes nothing.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

import calib  # noqa: F401 - registers the resolvers conf/ uses (--help's config groups)


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from calib.training import run

    run(OmegaConf.to_container(cfg, resolve=True))


if __name__ == "__main__":
    main()
