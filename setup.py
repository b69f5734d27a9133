"""Build hook for the optional compiled statistics kernel; all metadata lives in pyproject.toml.

The kernel (qlint/stats/_channel_kernel.c) makes calibration several times
cheaper; qlint works without it (``optional=True``: a machine with no C
compiler still installs, and the statistics fall back to tensor ops with the
same results). See docs/architecture.md, "Compiled statistics kernel".
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "qlint.stats._channel_kernel",
            sources=["qlint/stats/_channel_kernel.c"],
            # included by _channel_kernel.c (one translation unit)
            depends=["qlint/stats/_kernel_selection.h", "qlint/stats/_kernel_channel_last.h",
                     "qlint/stats/_kernel_channel_major.h"],
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math"],
            optional=True,
        )
    ]
)
