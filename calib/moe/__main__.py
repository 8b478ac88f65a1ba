"""``python -m calib.moe [stage=all|moefy|capture|analyze] [analyze.routing=BANK] ...`` (Hydra, conf/moe.yaml).

* ``moefy``: split the dense target's MLPs into experts and fit shadow routers (PROXY testbed).
* ``capture``: speculative decoding with the n-gram drafter, recording the shadow routing of every
  verified position into a bank in the public routing layout.
* ``analyze`` (default): on any routing capture, print the three distinct-expert models' errors on
  held-out requests, write the pictures, metrics.json and the break-even α (W&B offline too).
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

_CONF = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(config_path=_CONF, config_name="moe", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    c = OmegaConf.to_container(cfg, resolve=True)
    root = c.get("root") or "."
    stages = ["moefy", "capture", "analyze"] if c["stage"] == "all" else [c["stage"]]
    for s in stages:
        if s == "moefy":
            from calib.moe.moefy import moefy

            moefy(c["moefy"], root)
        elif s == "capture":
            from calib.moe.capture import capture

            capture(c["capture"], root)
        elif s == "analyze":
            from calib.moe.analysis import run_analysis

            run_analysis(c, root)
        else:
            raise ValueError(f"stage={s!r}: expected all, moefy, capture or analyze")


if __name__ == "__main__":
    main()
