"""Write data/prompts/holdout/code_edit.jsonl: up to 60 code-edit prompts (56 on CPython 3.11.7) that
neither calib's sample (data/prompts/code_edit.jsonl) nor the shipped EAGLE drafter's corpus (conf/eagle.yaml:
corpus.n_code_edit stdlib functions, seed 0) touched: build_code_edit.py's candidates, edits and
instructions, drawn only from standard-library files that no sample prompt and no corpus code edit comes
from (same seed, one snippet per file, at most three per module; edit kinds round-robin, a kind with no
candidate left is skipped).

    python data/prompts/holdout/build_code_edit.py    # CPython 3.11.7: byte-identical output
"""
import argparse
import json
import platform
import random
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from calib.drafters.eagle import corpus

N_PROMPTS = 60
PER_MODULE = 3  # the sample allows two; the files left after the sample and the corpus hold 47 prompts at two
SAMPLE_DIR = ROOT / "data" / "prompts"   # its top-level *.jsonl: the sample prompts
OUT_PATH = Path(__file__).with_name("code_edit.jsonl")


def drafter_corpus_files(stdlib: Path, skip_files: set[str], n_code_edit: int, seed: int) -> set[str]:
    """The stdlib files the drafter corpus's code edits quote (corpus._code_edits' selection)."""
    bce = corpus.build_code_edit()
    cands = sorted((c for c in bce.candidates(stdlib) if c["file"] not in skip_files),
                   key=lambda c: (c["file"], c["start"]))
    random.Random(seed).shuffle(cands)
    return {c["file"] for c in cands[:n_code_edit]}


def build(stdlib: Path, n_code_edit: int = 600, seed: int = 0) -> list[dict]:
    bce = corpus.build_code_edit()
    _, _, sample_files = corpus.excluded_prompts([SAMPLE_DIR])
    skip = sample_files | drafter_corpus_files(stdlib, sample_files, n_code_edit, seed)
    cands = sorted((c for c in bce.candidates(stdlib) if c["file"] not in skip), key=lambda c: (c["file"], c["start"]))
    rng = random.Random(bce.SEED)
    rng.shuffle(cands)
    used_files, used_mods, used_idx, dead, records, i = {}, {}, set(), set(), [], 0
    while len(records) < N_PROMPTS and len(dead) < len(bce.EDIT_KINDS):
        kind = bce.EDIT_KINDS[i % len(bce.EDIT_KINDS)]
        i += 1
        if kind in dead:
            continue
        for j, cand in enumerate(cands):
            if (j not in used_idx and kind in cand["kinds"] and used_files.get(cand["file"], 0) < bce.PER_FILE
                    and used_mods.get(cand["module"], 0) < PER_MODULE):
                break
        else:
            dead.add(kind)
            continue
        used_idx.add(j)
        used_files[cand["file"]] = used_files.get(cand["file"], 0) + 1
        used_mods[cand["module"]] = used_mods.get(cand["module"], 0) + 1
        records.append({"id": f"holdout_code_edit-{len(records):03d}", "category": "code_edit",
                        "messages": [{"role": "user", "content": bce.instruction(kind, cand["kinds"][kind], cand, rng)}],
                        "source": {"file": cand["file"], "start_line": cand["start"], "end_line": cand["end"],
                                   "python_version": platform.python_version()},
                        "edit": kind})
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_PATH, help="output JSONL path")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="standard library directory to read")
    args = ap.parse_args()
    records = build(args.stdlib)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
