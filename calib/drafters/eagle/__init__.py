"""An EAGLE-style draft head for Llama targets, in the layout vLLM 0.32 loads for ``method="eagle"``.

Work in progress (issue 3): the head, its training step (``training.EagleTrainingModule``) and the export
exist and are tested; the
corpus / self-distillation / hidden-state extraction recipe and the trained head do not yet.
"""

from calib.drafters.eagle.export import export_head
from calib.drafters.eagle.model import EagleHead, eagle_loss

__all__ = ["EagleHead", "eagle_loss", "export_head"]
