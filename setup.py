"""Build hook for the optional C accelerators; all metadata lives in pyproject.toml.

`pip install -e .` compiles `indexer._native._kvnative` (the index core), `indexer._native._zmqdrain`
(the subscriber's receive loop) and `producer._native._pagehash` (page hashing and the event encoder).
If a compiler or headers are missing the build goes on without that one (optional=True) and its
package falls back to its pure-Python path (the index core says so in a warning at import).
"""
import importlib.util
import os

from setuptools import Extension, setup


def _c_tables():
    """cbuild/tables.py loaded by path: the build runs in pip's isolated environment, where the
    `schemas` package itself (msgspec) cannot be imported; this one module needs only the stdlib."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cbuild", "tables.py")
    spec = importlib.util.spec_from_file_location("kvatlas_c_tables", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_tables = _c_tables()
KVNATIVE_FILES, PAGEHASH_FILES, PAGEHASH_SOURCES = _tables.KVNATIVE_FILES, _tables.PAGEHASH_FILES, _tables.PAGEHASH_SOURCES
source_digest = _tables.source_digest


def digest_macro(files: tuple[str, ...]) -> list[tuple[str, str]]:
    """SOURCE_DIGEST: the digest of the sources a build is compiled from (its loader compares it)."""
    return [("SOURCE_DIGEST", f'"{source_digest(files)}"')]


setup(
    ext_modules=[
        Extension(
            "indexer._native._kvnative",
            # One translation unit: kvnative.c (module glue) includes the parts below in order.
            sources=["indexer/_native/kvnative.c"],
            depends=list(KVNATIVE_FILES[1:]),
            define_macros=digest_macro(KVNATIVE_FILES),
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
        # The producer's C helper: page-hash chains (SHA-256 with OpenSSL's libcrypto or the CPU's
        # SHA unit, XXH3 from the vendored xxHash header) and the event batch encoder, whose tables
        # are generated from schemas/ (producer/_native/event_tables.py). Optional like the ones
        # above: without a compiler or libssl-dev, producer/page_hash.py and producer/events.py use
        # hashlib, the xxhash package and msgspec (docs/producer-events.md).
        Extension(
            "producer._native._pagehash",
            sources=list(PAGEHASH_SOURCES),
            depends=list(PAGEHASH_FILES[len(PAGEHASH_SOURCES):]),
            define_macros=digest_macro(PAGEHASH_FILES),
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-parameter"],
            libraries=["crypto"],
            optional=True,
        ),
    ]
)
