"""Pictures shared by the train and eval jobs (matplotlib, headless)."""

from calib.presentation.reliability import reliability_figure

__all__ = ["reliability_figure"]
