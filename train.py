"""Fit calibrators on banks and export tables: ``python train.py [overrides]`` (conf/train.yaml)."""

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from calib.training import run

    run(OmegaConf.to_container(cfg, resolve=True))


if __name__ == "__main__":
    main()
