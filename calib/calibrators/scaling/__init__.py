from calib.calibrators.scaling.temperature import TemperatureScaling

__all__ = ["TemperatureScaling"]
