"""``python -m calib.drafters.eagle [overrides]``: the EAGLE recipe (conf/eagle.yaml)."""

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="../../../conf", config_name="eagle", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from calib.drafters.eagle.recipe import run

    run(OmegaConf.to_container(cfg, resolve=True))


if __name__ == "__main__":
    main()
