"""Build hook for the optional native accelerator of the index core; all metadata lives in pyproject.toml.

`pip install -e .` compiles `indexer._native._kvnative` from plain C (CPython API only). If the
compiler or headers are missing the build goes on without it (optional=True) and the index falls back
to its pure-Python core, saying so in a warning at import.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "indexer._native._kvnative",
            sources=["indexer/_native/kvnative.c"],  # includes wire_walk.c (payload reader), groups_walk.c (hybrid rows)
            depends=["indexer/_native/wire_walk.c", "indexer/_native/groups_walk.c", "indexer/_native/wire_tables.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-parameter", "-Wconversion", "-Wno-sign-conversion"],
            optional=True,
        ),
        # The live subscriber's receive loop over libzmq's message API (resolved at run time from
        # the libzmq pyzmq loaded: nothing to link); optional, indexer/zmqdrain.py falls back to pyzmq.
        Extension(
            "indexer._native._zmqdrain",
            sources=["indexer/_native/zmqdrain.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-parameter"],
            libraries=["dl"],
            optional=True,
        ),
        # Producer page-hash chains (SHA-256 written from FIPS 180-4: no libssl needed); optional
        # like the one above, producer/page_hash.py falls back to hashlib (docs/producer-events.md).
        Extension(
            "producer._native._pagehash",
            sources=["producer/_native/pagehash.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
