"""Serve a prompt set with vLLM offline, with or without calib deciding the drafts: ``python serve.py [overrides]``."""

import hydra
from omegaconf import DictConfig, OmegaConf

from calib.policies.config_store import store_policy_configs

store_policy_configs()  # the `policy` group (policy=<name>) comes from calib.policies' registry


@hydra.main(config_path="conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from calib.vllm.serve_runner import run

    run(OmegaConf.to_container(cfg, resolve=True))


if __name__ == "__main__":
    main()
