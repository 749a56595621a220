"""Test-only: with TRAINER_TEST_BREAK_FP8=1, float8 scales are 16x too large, so casts saturate.

Put this folder on PYTHONPATH to make FP8 deliberately wrong (tests of scripts/fp8_parity.py
must be able to fail). Never imported by the trainer itself.
"""

import os

if os.environ.get("TRAINER_TEST_BREAK_FP8") == "1":
    import torchao.float8.float8_utils as float8_utils

    _amax_to_scale = float8_utils.amax_to_scale

    def _broken_amax_to_scale(*args, **kwargs):
        return _amax_to_scale(*args, **kwargs) * 16

    float8_utils.amax_to_scale = _broken_amax_to_scale
