"""What each command line prints for ``--help``: its own config groups (Hydra) or plain text (argparse).

Hydra entry points choose ``hydra/help: calib`` (conf/hydra/help/calib.yaml), whose template lists, through
the ``${calib.help_groups:}`` resolver (:func:`help_groups`), only the config groups that the entry point's
primary config's defaults list reads, with each group's options, instead of every group under conf/.
argparse entry points print their docstring through :func:`plain_text`, which turns the reStructuredText
of a docstring (````code````, ``:func:`name```, ``*emphasis*``) into plain text.
"""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")  # :func:`calib.x.y`, :py:meth:`~a.b`
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"(?<![\w*])\*\*?([^*\s][^*]*?)\*\*?(?![\w*])")


def plain_text(rst: str) -> str:
    """A docstring's reStructuredText as plain text: roles and literals lose their markup (``:func:`a.b```
    -> ``a.b``, ````x```` -> ``x``), ``*x*`` and ``**x**`` -> ``x``; ``::`` ending a line -> ``:``."""
    text = _ROLE.sub(r"\1", rst)
    text = _LITERAL.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    text = re.sub(r"(?m)(\S)::$", r"\1:", text)
    return text.strip("\n") + "\n"


def parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """An argparse parser whose description is ``doc`` in plain text, its line breaks kept."""
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=plain_text(doc or ""), **kwargs)


def primary_groups(config_loader, config_name: str, overrides: list[str]) -> dict[str, list[str]]:
    """group -> options chosen, for the groups the primary config's defaults list (and a config it
    extends, as eagle_reduced extends eagle) selects; groups a chosen option pulls in itself, and Hydra's
    own (``hydra/...``), are left out."""
    from hydra.types import RunMode

    dl = config_loader.compute_defaults_list(config_name, overrides, RunMode.RUN)
    groups: dict[str, list[str]] = {}
    for d in dl.defaults:
        path = d.config_path or ""
        if "/" not in path or path.startswith("hydra/") or "/" in (d.parent or ""):
            continue
        group, option = path.rsplit("/", 1)
        groups.setdefault(group, []).append(option)
    return groups


def format_groups(config_loader, groups: dict[str, list[str]]) -> str:
    lines = []
    for group in sorted(groups):
        options = [o for o in sorted(config_loader.get_group_options(group)) if not o.startswith("_")]
        lines.append(f"{group}: {', '.join(options)}   (chosen: {', '.join(groups[group])})")
    return "\n".join(lines) if lines else "(none: this entry point reads no config group)"


def help_groups() -> str:
    """``${calib.help_groups:}``: the config groups this run's primary config reads, one line each."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    loader = GlobalHydra.instance().config_loader()
    overrides = [o for o in hc.overrides.task if not o.startswith("hydra")]
    return format_groups(loader, primary_groups(loader, hc.job.config_name, overrides))
