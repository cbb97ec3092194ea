"""Minimal reproduction of the first C++ errors raised by the extension (a shape error inside
MoELayer.forward on a cpu-backend layer, and one in quantize_input). On the H200 image they
crashed the process: the extension had been linked with a static libstdc++ there, and formatting
a number into the error message crashed in std::num_put (fixed in python/CMakeLists.txt by
linking libstdc++.so.6). Kept as the first thing bench/gpu_session.sh runs in its python step:

    MEGAMOE_CRASH_TRACE=1 PYTHONPATH=BUILD/python python3 tests/python/repro_forward_error.py [--torch]
    (BUILD configured with -DMEGAMOE_PY_CRASH_TRACE=ON for the native backtrace)
    cuda-gdb -batch -ex run -ex bt --args python3 tests/python/repro_forward_error.py

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
