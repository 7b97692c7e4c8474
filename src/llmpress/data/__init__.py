from llmpress.data.calibration import CalibrationOptions, batch_samples, load_calibration_samples

__all__ = ["CalibrationOptions", "batch_samples", "load_calibration_samples"]
