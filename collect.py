"""Collect a bank of speculative-decoding rounds from vLLM: ``python collect.py [overrides]``."""

import hydra
from omegaconf import DictConfig, OmegaConf

import calib  # noqa: F401 - registers the resolvers conf/ uses (--help's config groups)


@hydra.main(config_path="conf", config_name="collect", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from calib.collect.runner import run

    run(OmegaConf.to_container(cfg, resolve=True))


if __name__ == "__main__":
    main()
