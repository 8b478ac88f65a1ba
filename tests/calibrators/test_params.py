"""Parameters of calibrators and n-gram models: get_params, declarative validation, progress, logging
(SYNTHETIC samples)."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from calib.calibrators.base import with_depth
from calib.calibrators.binning import HistogramBinning, IsotonicPerDepth
from calib.calibrators.features import GradientBoostingAcceptance, LogisticAcceptance, MLPAcceptance
from calib.calibrators.scaling import TemperatureScaling

ROOT = Path(__file__).resolve().parents[2]


def model_samples(n=600, seed=0):
    rng = np.random.default_rng(seed)
    conf = rng.uniform(size=n)
    return pd.DataFrame({"conf": conf, "depth": rng.integers(0, 3, n),
                         "label": (rng.uniform(size=n) < conf).astype(int),
                         "split": np.where(np.arange(n) % 4 == 0, "val", "train"),
                         "category": "chat", "prompt_idx": np.arange(n) // 10})  # 10 rows per prompt


def ngram_frame(n=400, seed=0):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"match_n": rng.integers(1, 5, n), "occurrences": rng.integers(1, 9, n),
                       "agreement": rng.uniform(size=n), "depth": rng.integers(0, 3, n)})
    return df, (rng.uniform(size=n) < 0.2 * df.match_n).astype(int).to_numpy()


def test_identity_wins_selection_and_reports_params():
    # Before: get_params read object.__init__'s (*args, **kwargs) -> AttributeError after all fitting.
    from calib.training import fit_model_calibrator

    candidates = {"identity": {"_target_": "calib.calibrators.identity.Identity"}}
    res = fit_model_calibrator(model_samples(), candidates)
    assert res["choice"] == {0: "identity", 1: "identity", 2: "identity"}
    best = res["estimator"].chosen_estimators_["identity"]
    assert best.get_params() == {} and repr(best) == "Identity()"
    assert res["estimator"].get_params(deep=False)["candidates"]["identity"].get_params() == {}


def test_get_params_of_every_estimator():
    assert HistogramBinning(n_bins=7).get_params() == {"n_bins": 7, "min_samples": 200, "prior": 1.0}
    assert TemperatureScaling(optimizer="adam").get_params()["optimizer"] == "adam"
    assert GradientBoostingAcceptance(features=["match_n"]).get_params()["features"] == ("match_n",)


@pytest.mark.parametrize("make, param, value, allowed", [
    (lambda: TemperatureScaling(optimizer="lbgfs"), "optimizer", "'lbgfs'", "one of 'lbfgs', 'adam'"),
    (lambda: TemperatureScaling(per_depth="false"), "per_depth", "'false'", "a bool"),
    (lambda: TemperatureScaling(lr=0.0), "lr", "0.0", "a finite number in (0, inf)"),
    (lambda: HistogramBinning(n_bins=0), "n_bins", "0", "an integer in [1, inf)"),
    (lambda: IsotonicPerDepth(clip=0.5), "clip", "0.5", "a finite number in [0, 0.5)"),
])
def test_model_calibrator_params_are_validated_in_fit(make, param, value, allowed):
    # Before: optimizer="lbgfs" silently trained Adam; the others failed deep inside or not at all.
    c = np.array([0.2, 0.8, 0.5, 0.9])
    message = f"parameter {param}={value} is invalid; it must be {allowed}"
    with pytest.raises(ValueError, match=re.escape(message)):
        make().fit(with_depth(c, [0, 0, 1, 1]), [0, 1, 0, 1])


@pytest.mark.parametrize("make, param", [
    (lambda: LogisticAcceptance(features=["match_len"]), "features"),
    (lambda: LogisticAcceptance(features="match_n"), "features"),
    (lambda: GradientBoostingAcceptance(max_iter=0), "max_iter"),
    (lambda: MLPAcceptance(hidden=0), "hidden"),
])
def test_ngram_params_are_validated_in_fit(make, param):
    df, y = ngram_frame()
    with pytest.raises(ValueError, match=rf"parameter {param}=.* is invalid; it must be") as err:
        make().fit(df, y)
    if param == "features":
        assert "'match_n'" in str(err.value) and "'context_len'" in str(err.value)  # the valid names


def test_hgb_fit_reports_progress_through_logging(caplog, capsys):
    # Before: the fit was silent (321 s in a multirun job); sklearn's own verbose output is print().
    df, y = ngram_frame(n=2000)
    with caplog.at_level(logging.INFO, logger="calib.calibrators.features.models"):
        model = GradientBoostingAcceptance(features=["match_n", "occurrences", "agreement"], max_iter=30)
        model.fit(df, y)
    lines = [r.getMessage() for r in caplog.records if r.name == "calib.calibrators.features.models"]
    assert any(m.startswith("hgb: fitting up to 30 boosting iterations") for m in lines)
    assert any(m.startswith("hgb [1/30]") for m in lines)  # the first iteration is always shown
    assert any(m.startswith(f"hgb: {model.model_.n_iter_} boosting iterations") for m in lines)
    assert capsys.readouterr().out == ""  # nothing printed around the logger


def test_lightning_lines_are_printed_once_under_a_configured_root_logger():
    # Before: "GPU available: ..." twice (Lightning's own console handler + propagation to root).
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='ROOT %(name)s %(message)s')\n"
        "import numpy as np\n"
        "from calib.calibrators.base import with_depth\n"
        "from calib.calibrators.scaling import TemperatureScaling\n"
        "rng = np.random.default_rng(0); c = rng.uniform(size=200)\n"
        "y = rng.uniform(size=200) < c\n"
        "TemperatureScaling(progress=False, max_epochs=1).fit(with_depth(c, rng.integers(0, 2, 200)), y)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    gpu = [line for line in (out.stdout + out.stderr).splitlines() if "GPU available" in line]
    assert len(gpu) == 1 and gpu[0].startswith("ROOT lightning.pytorch"), gpu
