"""bench/serve.py's arms on the clock (bench/lib/serve_arms.py), engines stood in (SYNTHETIC records): under
``--interleave cells`` each cell is served by every arm in turn while every engine stays alive, the order rotating
from cell to cell; a finished cell is kept and a rerun serves only what is missing; a worker that fails stops the run
naming its arm and log, every engine closed; ``cells`` runs only where the engines fit in memory and no GPU."""

import io
import json
import sys

import pytest

from tests.bench_scripts import BENCH

sys.path.insert(0, str(BENCH.parent))
from bench.lib import serve_arms

CELLS = [{"category": cat, "sampling": s, "concurrency": c, "max_tokens": 4, "n_prompts": 2}
         for cat in ("chat", "code_edit") for s in ("greedy", "sampled") for c in (1, 4)]
GREEDY = [c for c in CELLS if c["sampling"] == "greedy"]


class FakeWorker:
    def __init__(self, log, spec, fail_on=None):
        self.arm, self.log, self.fail_on, self.closed = spec["arm"], log, fail_on, False
        log.append(("start", self.arm, spec.get("max_num_seqs", None)))

    def serve(self, cell):
        if cell == self.fail_on:
            raise RuntimeError(f"arm {self.arm} rep 0 failed serving: boom; log x.log")
        self.log.append(("serve", self.arm, json.dumps(cell, sort_keys=True)))
        return {"arm": self.arm, "rep": 0, "cell": cell, "tok_s": 1.0}

    def close(self):
        self.closed = True
        self.log.append(("close", self.arm))


def _arm_cells():
    return {"none": CELLS, "vllm_ngram": CELLS, "calib_ngram": CELLS, "oracle_ngram": GREEDY}


def _overrides():
    return {a: [f"arm={a}"] for a in _arm_cells()}


def test_each_cell_is_served_by_every_arm_in_turn_the_order_rotating(tmp_path):
    log = []
    records = serve_arms.serve_rep_by_cells(_arm_cells(), 0, _overrides(), str(tmp_path), tmp_path,
                                            start=lambda spec, work, key: FakeWorker(log, spec),
                                            progress=lambda line: None, max_num_seqs=16)
    assert [e[1] for e in log if e[0] == "start"] == list(_arm_cells())  # every engine first, each once
    assert all(e[2] == 16 for e in log if e[0] == "start")
    served = [e for e in log if e[0] == "serve"]
    assert len(served) == len(records) == 3 * len(CELLS) + len(GREEDY)
    runs, firsts = [], []  # consecutive serves of one cell
    for e in served:
        if not runs or runs[-1][0] != e[2]:
            runs.append((e[2], []))
        runs[-1][1].append(e[1])
    assert len(runs) == len(CELLS)  # a cell's arms one after another, never split by another cell
    for cell, arms in runs:
        want = {"none", "vllm_ngram", "calib_ngram"} | ({"oracle_ngram"} if '"greedy"' in cell else set())
        assert sorted(arms) == sorted(want)
        firsts.append(arms[0])
    assert len(set(firsts)) >= 3  # the lead rotates from cell to cell
    assert [e[0] for e in log[-4:]] == ["close"] * 4
    assert len(list(tmp_path.glob("cell-0-*.json"))) == len(CELLS)


def test_a_rerun_serves_only_the_cells_still_missing(tmp_path):
    first = serve_arms.serve_rep_by_cells(_arm_cells(), 0, _overrides(), str(tmp_path), tmp_path,
                                          start=lambda spec, work, key: FakeWorker([], spec),
                                          progress=lambda line: None)

    def refuse(spec, work, key):
        raise AssertionError("no engine may start when every cell is kept")

    again = serve_arms.serve_rep_by_cells(_arm_cells(), 0, _overrides(), str(tmp_path), tmp_path, start=refuse,
                                          progress=lambda line: None)
    key = lambda r: (r["arm"], json.dumps(r["cell"], sort_keys=True))
    assert sorted(map(key, again)) == sorted(map(key, first))
    gone = min(tmp_path.glob("cell-0-*.json"))
    gone.unlink()
    log = []
    served = serve_arms.serve_rep_by_cells(_arm_cells(), 0, _overrides(), str(tmp_path), tmp_path,
                                           start=lambda spec, work, key: FakeWorker(log, spec),
                                           progress=lambda line: None)
    assert len(served) == len(first) and 3 <= len([e for e in log if e[0] == "serve"]) <= 4


def test_a_failing_worker_stops_the_run_naming_its_arm_and_closes_every_engine(tmp_path):
    workers = []

    def start(spec, work, key):
        workers.append(FakeWorker([], spec, fail_on=CELLS[1] if spec["arm"] == "calib_ngram" else None))
        return workers[-1]

    with pytest.raises(RuntimeError, match="arm calib_ngram rep 0 failed"):
        serve_arms.serve_rep_by_cells(_arm_cells(), 0, _overrides(), str(tmp_path), tmp_path, start=start,
                                      progress=lambda line: None)
    assert workers and all(w.closed for w in workers)
    kept = [json.loads(p.read_text()) for p in tmp_path.glob("cell-0-*.json")]
    assert all(CELLS[1] not in [r["cell"] for r in recs] for recs in kept)  # the failed cell is never kept
    assert not list(tmp_path.glob("*.partial"))


def test_the_worker_side_answers_each_cell_and_says_when_it_could_not():
    class Engine:
        finished = False

        def serve(self, cell):
            if cell["concurrency"] == 4:
                raise ValueError("no prompts")
            return {"cell": cell}

        def finish(self):
            self.finished = True

    engine, out = Engine(), io.StringIO()
    cmds = [{"cell": CELLS[0]}, {"cell": CELLS[1]}, {"quit": True}, {"cell": CELLS[0]}]
    serve_arms.pool_loop(engine, io.StringIO("".join(json.dumps(c) + "\n" for c in cmds)), out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ready": True} and replies[1] == {"record": {"cell": CELLS[0]}}
    assert replies[2] == {"error": "ValueError: no prompts"} and replies[3] == {"done": True}
    assert len(replies) == 4 and engine.finished  # nothing served after quit


MEMINFO = "MemTotal:       24000000 kB\nMemAvailable:   {} kB\n"


def test_cells_runs_only_where_every_engine_fits_and_no_gpu_and_says_what_to_do_otherwise():
    roomy, tight = MEMINFO.format(22 * 2**20), MEMINFO.format(12 * 2**20)
    assert "20.0 GiB needed, 22.0 GiB available" in serve_arms.check_interleave("cells", 6, 1, gpu=False,
                                                                                meminfo=roomy)  # 6 x (2 + 1) + 2
    with pytest.raises(ValueError, match=r"26.0 GiB needed, 22.0 GiB available.*kv_cache_gb=1.*--interleave arms"):
        serve_arms.check_interleave("cells", 6, 2, gpu=False, meminfo=roomy)  # 6 x (2 + 2) + 2
    with pytest.raises(ValueError, match="GPU.*--interleave arms"):
        serve_arms.check_interleave("cells", 2, 1, gpu=True, meminfo=roomy)
    assert serve_arms.check_interleave("arms", 60, 2, gpu=True, meminfo=tight)  # one engine at a time: always


def test_a_further_repetition_serves_the_unstable_cells_by_name():
    labels = ["chat/greedy/c4/calib_ngram", "chat/greedy/c4/none", "code_edit/sampled/c1/vllm_ngram"]
    from calib.evaluate import clock

    named = clock.unstable_cells(labels, CELLS)
    assert [(c["category"], c["sampling"], c["concurrency"]) for c in named] == [
        ("chat", "greedy", 4), ("code_edit", "sampled", 1)]


def test_kept_records_survive_a_commit_of_docs_but_not_one_of_the_served_code(tmp_path, monkeypatch):
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    for path in serve_arms.SERVED_PATHS:
        if "." not in path:
            (tmp_path / path).mkdir()
            (tmp_path / path / "x.py").write_text("a = 1\n")
        else:
            (tmp_path / path).write_text("x\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "y.md").write_text("y\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    monkeypatch.setattr(serve_arms, "ROOT", tmp_path)

    def digest():
        serve_arms.code_digest.cache_clear()
        return serve_arms.code_digest()

    first = digest()
    (tmp_path / "docs" / "y.md").write_text("y, measured\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "docs")
    assert digest() == first
    (tmp_path / "calib" / "x.py").write_text("a = 2\n")
    uncommitted = digest()
    assert uncommitted != first
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "code")
    assert digest() != first
    serve_arms.code_digest.cache_clear()


def test_a_real_worker_that_cannot_start_is_named_with_its_log_and_not_left_running(tmp_path):
    """The protocol over a real worker process (bench/serve.py --worker): a config error before the engine is
    built ends the process; the parent says which arm, what it was doing, and the log's tail."""
    spec = serve_arms.arm_spec("none", 0, CELLS[:1], ["policy=no_such_policy"])
    with pytest.raises(RuntimeError, match=r"arm none rep 0 failed starting its engine.*log .*none-0-k\.pool\.log"):
        serve_arms.PoolWorker(spec, tmp_path, "k")
    assert "no_such_policy" in (tmp_path / "none-0-k.pool.log").read_text()
