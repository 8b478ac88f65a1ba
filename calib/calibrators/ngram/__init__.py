"""Feature-based acceptance models for n-gram (prompt-lookup) chains: P(accept at k | reached k)."""

from calib.calibrators.ngram.models import (
                                            GradientBoostingAcceptance,
                                            LogisticAcceptance,
                                            MLPAcceptance,
                                            NgramAcceptanceModel,
)

__all__ = ["GradientBoostingAcceptance", "LogisticAcceptance", "MLPAcceptance", "NgramAcceptanceModel"]
