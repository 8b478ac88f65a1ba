"""calib: calibrated acceptance for speculative decoding."""
__version__ = "0.1.0"


def _draft_cost(drafter_dir=None) -> float:
    """``${calib.draft_cost:DRAFTER}`` in conf/: :func:`calib.cost.draft.draft_cost` (loaded on first use)."""
    from calib.cost.draft import draft_cost

    return draft_cost(drafter_dir)


def _help_groups() -> str:
    """``${calib.help_groups:}`` in conf/hydra/help/calib.yaml: the config groups an entry point reads."""
    from calib.cli import help_groups

    return help_groups()


def _help_keys(*, _root_) -> str:
    """``${calib.help_keys:}`` in conf/hydra/help/calib.yaml: the composed config's top-level settings."""
    from calib.cli import help_keys

    return help_keys(_root_)


def _register_config_resolvers() -> None:
    """The resolvers conf/ uses, registered before any config is composed or loaded (a calib import)."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        return
    if not OmegaConf.has_resolver("calib.draft_cost"):
        OmegaConf.register_new_resolver("calib.draft_cost", _draft_cost)
    if not OmegaConf.has_resolver("calib.help_groups"):
        OmegaConf.register_new_resolver("calib.help_groups", _help_groups)
    if not OmegaConf.has_resolver("calib.help_keys"):
        OmegaConf.register_new_resolver("calib.help_keys", _help_keys)


_register_config_resolvers()
