"""Build script for fastload's optional C extension; all metadata lives in pyproject.toml.

``fastload._jpeg`` (region-of-interest JPEG decoding) links the system libjpeg-turbo
(Debian/Ubuntu: ``libjpeg-dev``; Fedora: ``libjpeg-turbo-devel``; macOS: ``brew install jpeg-turbo``).
It is optional: without a compiler or the headers the build prints a warning and fastload
decodes with torchvision.io / PIL instead (same pixels, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastload._jpeg",
            sources=["fastload/_jpeg.c"],
            libraries=["jpeg", "m"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
