"""The shared Lightning fit loop: one intra-op thread while it trains, the caller's count after."""

import numpy as np
import torch

from calib.calibrators.base import with_depth
from calib.calibrators.lightning_fit import torch_threads


def test_torch_threads_restores_the_count():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
    try:
        with torch_threads(1):
            raise RuntimeError
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_fit_restores_threads_and_is_thread_count_independent(monkeypatch):
    from calib.calibrators.scaling import TemperatureScaling

    rng = np.random.default_rng(0)
    conf = rng.uniform(0.01, 0.99, 5000)
    depth = rng.integers(0, 4, 5000)
    y = (rng.uniform(size=5000) < conf ** 1.5).astype(int)
    before = torch.get_num_threads()
    fits = [TemperatureScaling(progress=False, max_epochs=5).fit(with_depth(conf, depth), y)]
    assert torch.get_num_threads() == before
    from calib.calibrators import lightning_fit

    monkeypatch.setattr(lightning_fit, "FIT_THREADS", None)  # torch's own count
    fits.append(TemperatureScaling(progress=False, max_epochs=5).fit(with_depth(conf, depth), y))
    assert np.array_equal(fits[0].a_, fits[1].a_) and np.array_equal(fits[0].b_, fits[1].b_)


def test_lightning_start_up_lines_are_shown_at_the_first_fit_only(caplog, monkeypatch):
    """SYNTHETIC data; "GPU available: ..." once per process, not once per fit."""
    import logging

    from calib.calibrators import lightning_fit
    from calib.calibrators.scaling import TemperatureScaling

    rng = np.random.default_rng(1)
    conf, depth = rng.uniform(0.01, 0.99, 2000), rng.integers(0, 2, 2000)
    y = (rng.uniform(size=2000) < conf).astype(int)
    monkeypatch.setattr(lightning_fit, "_FITS_RUN", 0)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            TemperatureScaling(progress=False, max_epochs=2).fit(with_depth(conf, depth), y)
    assert sum("GPU available" in r.getMessage() for r in caplog.records) == 1
    assert logging.getLogger(lightning_fit.LIGHTNING_BANNER).level == logging.NOTSET  # restored
