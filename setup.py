"""Build script for fastload's optional C extension; all metadata lives in pyproject.toml.

``fastload._jpeg`` (region-of-interest JPEG decoding) links the system libjpeg-turbo
(Debian/Ubuntu: ``libjpeg-dev``; Fedora: ``libjpeg-turbo-devel``; macOS: ``brew install jpeg-turbo``).
It is optional: without a compiler or the headers the build prints a warning and fastload
decodes with torchvision.io / PIL instead (same pixels, slower).

``fastload._nvimgcodec`` (whole batches of JPEG regions through nvImageCodec's C API, without the
interpreter) needs no library at build time: it opens nvImageCodec's, where installed, at run time.
Also optional: without it, fastload calls nvImageCodec through its Python API.

``fastload._resample`` (the filter taps of a batch's antialiased resize, made without the
interpreter) needs nothing but a C compiler; without it, numpy makes the same taps.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastload._jpeg",
            sources=["fastload/_jpeg.c"],
            libraries=["jpeg", "m"],
            # -ffp-contract=off: one rounding per float operation even where CFLAGS enable FMA (e.g.
            # -march=native), as the arithmetic checked against torch's and Pillow's bits assumes
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "fastload._resample",
            sources=["fastload/_resample.c"],
            # one rounding per float operation: the taps are checked bit for bit against numpy's
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "fastload._nvimgcodec",
            sources=["fastload/_nvimgcodec.c"],
            libraries=["dl", "pthread"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
