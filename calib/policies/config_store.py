"""The Hydra ``policy`` config group (``serve.py policy=<name>``), derived from the registry: one node per
servable policy and per alias. Call :func:`store_policy_configs` before composing ``conf/serve.yaml``."""

from __future__ import annotations

from calib.policies.base import serving_nodes

GROUP = "policy"


def store_policy_configs() -> tuple[str, ...]:
    """Store every servable policy's node (and each alias's) in Hydra's ConfigStore under ``policy/``;
    safe to call again (a policy registered since is added). Returns the names stored."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    nodes = serving_nodes()
    for name, node in nodes.items():
        store.store(group=GROUP, name=name, node=node)
    return tuple(nodes)
