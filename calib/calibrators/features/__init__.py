"""Small models on a chain's feature matrix (logistic, gradient boosting, MLP): P(accept at k | reached k).

They read named features: the n-gram chain's match features, the model chain's confidence with its
entropy and margin, and any context axis (:data:`calib.chains.CONTEXT`). One pooled fit learns how
much each feature matters; the exported table distils it per table cell (:mod:`calib.tables.export`).
"""

from calib.calibrators.features.models import (
    FeatureModel,
    GradientBoostingAcceptance,
    LogisticAcceptance,
    MLPAcceptance,
)

__all__ = ["FeatureModel", "GradientBoostingAcceptance", "LogisticAcceptance", "MLPAcceptance"]
