"""C extensions; everything else is declared in pyproject.toml."""
from setuptools import Extension, setup

EXTENSIONS: list[Extension] = [
    # Chained SHA-256 for the prefix cache; plain C, no -msha: SHA-NI code is per-function targeted.
    Extension(
        "kvcache.allocator._chainhash",
        ["allocator/_chainhash.c"],
        depends=["allocator/_tokens.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    ),
    # Batch lookups/inserts/removals of packed 32-byte hashes for the prefix index.
    Extension(
        "kvcache.allocator._hashtable",
        ["allocator/_hashtable.c"],
        depends=["allocator/_hashtable.h", "allocator/_arrays.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
    # One column written into each of many per-request block tables (a decode step's new blocks).
    Extension(
        "kvcache.allocator._tables",
        ["allocator/_tables.c"],
        depends=["allocator/_pool.h", "allocator/_hashtable.h", "allocator/_arrays.h", "allocator/_tokens.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
    # A request's references dropped row by row in one pass (BlockPool.decref of a whole table).
    Extension(
        "kvcache.allocator._pool",
        ["allocator/_pool.c"],
        depends=["allocator/_pool.h", "allocator/_arrays.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
    # send_cache and the layer signal: futex + shared memory; the CUDA runtime is dlopen'ed at run time.
    Extension(
        "kvcache.ops._send_cache",
        ["ops/_send_cache.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
        libraries=["dl", "rt"],
    ),
    # The merged byte ranges of a block-to-block KV copy (PD writes), built in one pass.
    Extension(
        "kvcache.transfer._ranges",
        ["transfer/_ranges.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
    # A host tier's load plan for a one-row manager (an admit's host hit) in one pass.
    Extension(
        "kvcache.transfer._tier",
        ["transfer/_tier.c"],
        depends=["allocator/_arrays.h", "allocator/_pool.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
    # Host memcpy over a whole list of KV byte ranges in one call, without the GIL.
    Extension(
        "kvcache.transfer._copy",
        ["transfer/_copy.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
    # The daemon protocol's msgpack codec, arrays included, without a Python call per array.
    Extension(
        "kvcache._wire",
        ["kvcache/_wire.c"],
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra"],
    ),
]

setup(ext_modules=EXTENSIONS)
