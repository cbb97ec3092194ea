"""Minimal reproduction of the first C++ error raised inside MoELayer.forward (a shape error on a
cpu-backend layer, thrown while the GIL is released). On the H200 image it crashed the process
(tests/python/test_errors.py::test_forward_shape_and_layout_errors_are_value_errors); run it
under gdb there to get the native backtrace:

    PYTHONPATH=BUILD/python python3 tests/python/repro_forward_error.py [--torch]
    gdb -batch -ex run -ex bt --args python3 tests/python/repro_forward_error.py [--torch]

--torch imports torch first (as pytest's collection of test_gpu.py does). Not a pytest module.
"""
import faulthandler
import os
import sys

faulthandler.enable()
if "--torch" in sys.argv:
    import torch  # noqa: F401  (loaded first, as in the pytest run)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megamoe  # noqa: E402
from conftest import make_inputs, tiny_config  # noqa: E402

cfg = tiny_config()
layer = megamoe.MoELayer(cfg, megamoe.synthetic_weights(cfg, 1), "cpu")
x, idx, w = make_inputs(cfg, 6, seed=1)
print("good call:", layer.forward(x, idx, w).shape, flush=True)
try:
    megamoe.quantize_input(x[:, :50].copy())  # a C++ error in another GIL-released binding
except Exception as e:  # noqa: BLE001
    print("quantize error raised:", type(e).__name__, e, flush=True)
try:
    layer.forward(x[:, :64].copy(), idx, w)
    print("FAIL: no error raised", flush=True)
except megamoe.InvalidArgumentError as e:
    print("forward error raised:", type(e).__name__, e, flush=True)
