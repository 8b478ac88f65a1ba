"""calib: calibrated acceptance for speculative decoding."""
__version__ = "0.1.0"


def _draft_cost(drafter_dir=None) -> float:
    """``${calib.draft_cost:DRAFTER}`` in conf/: :func:`calib.cost.draft.draft_cost` (loaded on first use)."""
    from calib.cost.draft import draft_cost

    return draft_cost(drafter_dir)


def _register_config_resolvers() -> None:
    """The resolvers conf/ uses, registered before any config is composed or loaded (a calib import)."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        return
    if not OmegaConf.has_resolver("calib.draft_cost"):
        OmegaConf.register_new_resolver("calib.draft_cost", _draft_cost)


_register_config_resolvers()
