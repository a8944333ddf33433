"""Build hook for the optional C accelerators; all metadata lives in pyproject.toml.

`pip install -e .` compiles `indexer._native._kvnative` (the index core), `indexer._native._zmqdrain`
(the subscriber's receive loop) and `producer._native._pagehash` (page hashing and the event encoder).
If a compiler or headers are missing the build goes on without that one (optional=True) and its
package falls back to its pure-Python path (the index core says so in a warning at import).
"""
from setuptools import Extension, setup

# The parts kvnative.c includes (one translation unit, so their functions stay static).
KVNATIVE_PARTS = ("hashing.c", "bodies.c", "u64map.c", "node_maps.c", "score_walk.c", "groups_walk.c", "answer.c",
                  "wire_walk.c", "groups_apply.c", "batch_apply.c")
# The producer helper's C files (also the Makefile's sanitize build: keep the two lists alike).
PAGEHASH_SOURCES = ("module", "chains", "pages", "msgpack", "batch")

setup(
    ext_modules=[
        Extension(
            "indexer._native._kvnative",
            # One translation unit: kvnative.c (module glue) includes the parts below in order.
            sources=["indexer/_native/kvnative.c"],
            depends=[f"indexer/_native/{f}" for f in KVNATIVE_PARTS] + ["indexer/_native/wire_tables.h"],
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
            sources=[f"producer/_native/{f}.c" for f in PAGEHASH_SOURCES],
            depends=["producer/_native/pagehash.h", "producer/_native/event_tables.h",
                     "producer/_native/third_party/xxhash.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-parameter"],
            libraries=["crypto"],
            optional=True,
        ),
    ]
)
