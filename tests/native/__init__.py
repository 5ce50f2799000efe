"""The C stand-in of the CUDA driver (fake_cuda_driver.c) and the flags the compiled parts'
CPU tests build with: `GRAPHSAN_TEST_SANITIZE=1` builds them with AddressSanitizer and
UndefinedBehaviorSanitizer (every finding aborts), for a run whose Python preloads the
AddressSanitizer runtime (`.ci/sanitizers` runs them so)."""

import os

SANITIZE = os.environ.get("GRAPHSAN_TEST_SANITIZE") == "1"
# gputable.cpp's interpreter table is a vtable made by hand, without type information: the
# vptr check, which reads that information, cannot apply to it
COMPILE_FLAGS: tuple[str, ...] = (
    (
        "-fsanitize=address,undefined",
        "-fno-sanitize=vptr",
        "-fno-sanitize-recover=all",
        "-fno-omit-frame-pointer",
        "-g",
    )
    if SANITIZE
    else ()
)
