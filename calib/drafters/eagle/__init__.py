"""An EAGLE-style draft head for Llama targets, in the layout vLLM 0.32 loads for ``method="eagle"``.

The recipe (``python -m calib.drafters.eagle``, ``conf/eagle.yaml``) runs, each stage cached:
``corpus`` (prompts; calib's own sample/test prompts excluded) → ``distill`` (the target's answers,
vLLM) → hidden states (the target's post-norm final states, transformers) → ``training`` (Lightning,
EAGLE loss) → ``export`` (safetensors + config). ``acceptance`` reports how a head did in a bank.
"""

__all__ = ["EagleHead", "eagle_loss", "export_head"]
_HOMES = {"EagleHead": "model", "eagle_loss": "model", "export_head": "export"}


def __getattr__(name: str):
    """The head and its export load on first use (PEP 562): ``python -m calib.drafters.eagle --help`` and the
    package's light modules (corpus, magpie) import no torch (issue 43)."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"calib.drafters.eagle.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
