from __future__ import annotations

import pytest
from smoothing_setup import calibration_and_eval_tokens


@pytest.fixture(scope="module")
def calibration_and_eval():
    """(16 calibration sequences of 128 tokens, 4 held-out ones as a tensor) of the fixture's text."""
    return calibration_and_eval_tokens()
