"""The weight codec: canonical hashes, full checkpoints and lossless deltas between two states.

A *state* is a ``dict[str, torch.Tensor]``. Everything here is a pure function of its inputs: no IO
(but numba's on-disk cache of compiled kernels), no globals that change a result (only a thread pool
and per-thread zstd contexts). This package re-exports nothing: import a name from the module that
defines it.

Numba-free (cheap to import; what hashing a state or reading a header costs)::

    state.py         State, DeltaError; state_sha256, encode_full / decode_full (safetensors)
    anchor.py        encode_anchor / decode_anchor, read_full (either format): compressed full
                     checkpoints (the registry's full versions), every length and digest checked
    planes.py        a tensor's bytes as float-aligned planes: 4-bit exponent codes, escapes,
                     sign+mantissa bytes; both ways, block by block
    delta.py         encode_delta(_with_summary), apply_delta, decode_unverified, resolve_device:
                     the public delta API; it imports the compiled side on first use
    container.py     the delta container (format version 3): magic, prefix, header, entry checks
    stats.py         delta_stats (sizes next to baselines), count_changed
    bitview.py       element bits as unsigned integers, order-preserving keys, zigzag
    streams.py       byte planes and zstd-coded fixed-width integer streams with escapes
    workers.py       the thread pool tensors are coded on and per-thread zstd contexts
    tensorfile.py    safetensors files read (mapped) and written one tensor at a time
    streaming.py     diff_files / apply_files: deltas between files in bounded memory; like
                     delta.py, it imports the compiled side inside its functions

Compiled side (imports numba; loaded only when a delta is first encoded or applied)::

    tensor_coding.py one tensor's header entry and payload, both ways (schemes same/sparse/full)
    changes.py       Changes (a tensor's changed elements by class) and the numba finder of them
    device.py        the same finder as torch ops on any torch device (a GPU's weights stay there)
    classes.py       magnitude classes: thresholds chosen on a sample of the tensor
    sparse.py        the sparse scheme's streams: Rice-coded rank gaps and the split step streams
    kernels.py       the numba kernels (scan, apply, Rice and step coding), cached on disk

No module of the first half imports one of the second at module level: the only ways across are
the function-level imports in ``delta.py`` and ``streaming.py``.
"""
