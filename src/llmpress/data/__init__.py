from llmpress.data.calibration import CalibrationOptions, batch_samples, load_calibration_samples, load_records, structure_batches

__all__ = ["CalibrationOptions", "batch_samples", "load_calibration_samples", "load_records", "structure_batches"]
