"""Test-only fault injection for tests/serve/test_serving_http.py (never on a user's path).

The HTTP test puts this folder first on the server's ``PYTHONPATH``, so every process of the server
(API server, engine core, worker) runs this file at interpreter start. It does nothing unless the
test sets ``CALIB_TEST_FAULT_AFTER=N`` (a variable of this test only; calib never reads it). Then,
when ``calib.serve.decide`` is first imported (in the worker: by the plugin's serving hooks, lazily),
``decide_step`` is wrapped: the first ``N`` calls decide normally, every later call raises
``RuntimeError("injected fault ...")``: an allocator failure mid-run. ``SafeDecider.decide`` looks
the step's decision (``_decide_step``, decide_step without its argument checks) up in its module's
globals at call time, so patching that module attribute is what it calls. Nothing is imported at start (vLLM sets up the CPU runtime before torch is imported): an
import hook patches the module right after it executes. Marker lines go to stderr (the server log).
"""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "calib.serve.decide"


def _patch(module) -> None:
    after = int(os.environ["CALIB_TEST_FAULT_AFTER"])
    orig = module._decide_step  # what SafeDecider calls each step
    calls = [0]

    def decide_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            if calls[0] == after + 1:
                print(f"calib-test-fault: decide_step ok {after} times, raising from call {calls[0]} "
                      f"(pid {os.getpid()})", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected fault (test): decide_step call {calls[0]}")
        return orig(*args, **kwargs)

    module._decide_step = decide_step
    print(f"calib-test-fault: patched {_TARGET}.decide_step (pid {os.getpid()})", file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path, target=None):
        if name != _TARGET or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return None
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CALIB_TEST_FAULT_AFTER"):
    sys.meta_path.insert(0, _Finder())
