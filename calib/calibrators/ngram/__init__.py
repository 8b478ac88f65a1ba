"""Where the feature models lived when only the n-gram chain used them; they are in
:mod:`calib.calibrators.features` now (configs naming ``calib.calibrators.ngram.*`` keep working)."""

from calib.calibrators.features.models import (
    FeatureModel,
    GradientBoostingAcceptance,
    LogisticAcceptance,
    MLPAcceptance,
)

NgramAcceptanceModel = FeatureModel  # the base class's earlier name

__all__ = ["GradientBoostingAcceptance", "LogisticAcceptance", "MLPAcceptance", "NgramAcceptanceModel"]
