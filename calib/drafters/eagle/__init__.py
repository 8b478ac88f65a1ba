"""An EAGLE-style draft head for Llama targets, in the layout vLLM 0.32 loads for ``method="eagle"``.

The recipe (``python -m calib.drafters.eagle``, ``conf/eagle.yaml``) runs, each stage cached:
``corpus`` (prompts; calib's own sample/test prompts excluded) → ``distill`` (the target's answers,
vLLM) → hidden states (the target's post-norm final states, transformers) → ``training`` (Lightning,
EAGLE loss) → ``export`` (safetensors + config). ``acceptance`` reports how a head did in a bank.
"""

from calib.drafters.eagle.export import export_head
from calib.drafters.eagle.model import EagleHead, eagle_loss

__all__ = ["EagleHead", "eagle_loss", "export_head"]
