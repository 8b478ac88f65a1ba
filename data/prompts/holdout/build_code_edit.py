"""Write data/prompts/holdout/code_edit.jsonl: up to 60 code-edit prompts (56 on CPython 3.11.7) that
neither calib's sample (data/prompts/code_edit.jsonl) nor the shipped EAGLE drafter's corpus (conf/eagle.yaml:
corpus.n_code_edit stdlib functions, seed 0) touched: build_code_edit.py's candidates, edits and
instructions, drawn only from standard-library files that no sample prompt and no corpus code edit comes
from (same seed, one snippet per file, at most three per module; edit kinds round-robin, a kind with no
candidate left is skipped).

    python data/prompts/holdout/build_code_edit.py    # CPython 3.11.7: byte-identical output
"""
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from calib.drafters.eagle import corpus

N_PROMPTS = 60
PER_MODULE = 3  # the sample allows two; the files left after the sample and the corpus hold 47 prompts at two
SAMPLE_DIR = ROOT / "data" / "prompts"   # its top-level *.jsonl: the sample prompts
OUT_PATH = Path(__file__).with_name("code_edit.jsonl")


def drafter_corpus_files(stdlib: Path, skip_files: set[str], n_code_edit: int, seed: int) -> set[str]:
    """The stdlib files the drafter corpus's code edits quote (the corpus's own selection)."""
    return {rec["source"]["file"] for rec in corpus._code_edits(n_code_edit, stdlib, skip_files, seed)}


def build(stdlib: Path, n_code_edit: int = 600, seed: int = 0) -> list[dict]:
    bce = corpus.build_code_edit()
    _, _, sample_files = corpus.excluded_prompts([SAMPLE_DIR])
    skip = sample_files | drafter_corpus_files(stdlib, sample_files, n_code_edit, seed)
    cands = sorted((c for c in bce.candidates(stdlib) if c["file"] not in skip), key=lambda c: (c["file"], c["start"]))
    rng = random.Random(bce.SEED)
    rng.shuffle(cands)
    return bce.pick(cands, rng, N_PROMPTS, per_module=PER_MODULE, id_prefix="holdout_code_edit", skip_exhausted=True)


if __name__ == "__main__":
    corpus.build_code_edit().main(build, OUT_PATH, __doc__)
