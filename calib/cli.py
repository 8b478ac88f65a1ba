"""What each command line prints for ``--help``: its own config groups (Hydra) or plain text (argparse).

Hydra entry points choose ``hydra/help: calib`` (conf/hydra/help/calib.yaml), whose template lists, through
the ``${calib.help_groups:}`` resolver (:func:`help_groups`), only the config groups that the entry point's
primary config's defaults list reads, with each group's options, instead of every group under conf/.
argparse entry points print their docstring through :func:`plain_text`, which turns the reStructuredText
of a docstring (````code````, ``:func:`name```, ``*emphasis*``) into plain text.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil

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


HELP_WIDTH = 110  # --help's width when stdout is not a terminal (piped, captured): the project's line length


def summary(text: str) -> str:
    """What ``--help`` shows of a plain-text docstring: its first paragraph and its indented example blocks
    (the lines that show how to run it); the rest waits for ``--help-all``."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip("\n")) if p.strip()]
    if not paragraphs:
        return ""
    keep = [paragraphs[0]] + [p for p in paragraphs[1:]
                              if all(line.startswith("    ") for line in p.splitlines()) and "python" in p]
    return "\n\n".join(keep) + "\n"


class _HelpAll(argparse.Action):
    """``--help-all``: the whole docstring as the description, then the options; exits like ``--help``."""

    def __init__(self, option_strings, dest, full: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.full = full

    def __call__(self, parser, namespace, values, option_string=None):
        parser.description = self.full
        parser.epilog = None
        parser.print_help()
        parser.exit()


def parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """An argparse parser whose ``--help`` is short: the docstring's first paragraph and its examples in plain
    text (:func:`summary`), the options, a pointer to ``--help-all`` (the whole docstring, its line breaks
    kept). Width: the terminal's, or :data:`HELP_WIDTH` when stdout is not one. Build it before importing
    anything heavy, so ``--help`` answers at once."""
    full = plain_text(doc or "")
    short = summary(full)
    formatter = kwargs.pop("formatter_class", argparse.RawDescriptionHelpFormatter)
    width = shutil.get_terminal_size((HELP_WIDTH, 24)).columns - 2
    kwargs["formatter_class"] = functools.partial(formatter, width=width, max_help_position=min(32, width // 3))
    if short != full:
        kwargs.setdefault("epilog", "--help-all prints the full description.")
    ap = argparse.ArgumentParser(description=short, **kwargs)
    if short != full:
        ap.add_argument("--help-all", action=_HelpAll, full=full, help="show the full description and exit")
    return ap


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


def _brief(value) -> str:
    """One setting's value on one line of ``--help``: a mapping by its keys, a list by its items."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, DictConfig):
        return "{" + ", ".join(str(k) for k in value) + "}"
    if isinstance(value, ListConfig):
        return "[" + ", ".join(_brief(v) for v in OmegaConf.to_container(value, resolve=False)) + "]"
    if isinstance(value, (dict, list)):
        return str(value)
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def help_keys(root) -> str:
    """``${calib.help_keys:}``: the composed config's top-level settings, one line each (a mapping shows its
    keys, an interpolation itself, unresolved); ``--cfg job`` prints them in full. Hydra fills the help
    template with :class:`string.Template`, so each ``$`` is doubled."""
    from omegaconf import OmegaConf

    width = shutil.get_terminal_size((HELP_WIDTH, 24)).columns - 2
    lines = []
    for key in root:
        if key == "hydra":
            continue
        node = root._get_node(key)
        value = node if OmegaConf.is_config(node) else node._value()
        line = f"{key}: {_brief(value)}"
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return "\n".join(lines).replace("$", "$$")


def worker_env(root) -> dict:
    """The environment of a bench's worker process (``python bench/X.py --worker``): offline, and ``root`` first on
    ``PYTHONPATH``. A script's own folder, not the working directory, heads a worker's ``sys.path``, so with calib
    installed editable from another tree (a clone benched beside the tree being edited) the worker would serve that
    tree's code while its JSON names the clone's commit."""
    import os

    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
            "PYTHONPATH": path}
