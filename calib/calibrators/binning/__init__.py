from calib.calibrators.binning.histogram import HistogramBinning
from calib.calibrators.binning.isotonic import IsotonicPerDepth

__all__ = ["HistogramBinning", "IsotonicPerDepth"]
