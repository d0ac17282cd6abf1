"""The numba kernels: the per-element work of the sparse scheme, one pass over a tensor each way.

Finding the changed elements, their classes and ranks (:func:`nb_scan`), the decoder's scatter
(:func:`nb_apply`), Rice coding of rank gaps and the split step streams: no temporaries the size of
the tensor. Work is done on words of 64 elements: bit masks of the changed elements and of the class
of every old element are built with vector instructions, and ranks come from popcounts, so both
directions are one pass over the tensor plus work per changed element. The kernels release the GIL,
so tensors code in parallel on the thread pool. All arithmetic on element bits is done in uint64
with explicit masks to the element width.

Compiled on first call and cached on disk (``cache=True``), so a later process loads them instead
of compiling: in ``NUMBA_CACHE_DIR`` where that is set, else next to this module in ``__pycache__``
(beside the ``.pyc`` files) where that is writable, else in numba's user-wide cache
(``~/.cache/numba``), else compiled once per process (:func:`kernel`). Numba checks a cached
kernel against its own source file only, so kernels that call one another live in one file (this
one); ``classes.py``'s kernels call none from here.

Importing this module imports numba (about a tenth of a second and a JIT compiler): only the encode
and apply paths do, never hashing or reading a header.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir as llvmir
from numba.core import cgutils
from numba.core.extending import intrinsic

_U64 = np.uint64


def kernel(**options: Any) -> Any:
    """``numba.njit`` without the GIL, cached on disk where numba finds a writable place (else
    compiled once per process)."""
    def wrap(fn: Any) -> Any:
        try:
            return numba.njit(nogil=True, cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(nogil=True, **options)(fn)
    return wrap


@intrinsic
def _popcount(typingctx, x):  # pragma: no cover - compiled
    """Set bits of a uint64 (llvm.ctpop)."""
    def codegen(context, builder, signature, args):
        fnty = llvmir.FunctionType(llvmir.IntType(64), [llvmir.IntType(64)])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.ctpop.i64"), args)
    return numba.types.uint64(numba.types.uint64), codegen


@intrinsic
def _trailing_zeros(typingctx, x):  # pragma: no cover - compiled
    """Index of the lowest set bit of a non-zero uint64 (llvm.cttz)."""
    def codegen(context, builder, signature, args):
        fnty = llvmir.FunctionType(llvmir.IntType(64), [llvmir.IntType(64), llvmir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i64")
        return builder.call(fn, [args[0], llvmir.Constant(llvmir.IntType(1), 0)])
    return numba.types.uint64(numba.types.uint64), codegen


@kernel()
def _nb_key(x, sign, full, shift):  # pragma: no cover - compiled
    """Order-preserving key of sign-magnitude bits ``x`` (see :func:`.bitview.order_keys`), without
    branches."""
    neg = _U64(0) - (x >> shift)
    return x ^ (sign | (neg & full))


@kernel()
def _nb_unkey(k, sign, full, shift):  # pragma: no cover - compiled
    neg = _U64(0) - (k >> shift)
    return k ^ ((neg & sign) | (~neg & full))


@kernel(inline="always")
def _nb_emit(old, new, x, members, before, base, c, gaps, steps, k, last, floating, sign, full, shift):  # pragma: no cover
    """The changed elements ``x`` (bits of a word at ``base``) of one class whose members in the
    word are ``members`` and ``before`` before it: their gaps and steps appended at ``k``."""
    while x:
        p = _trailing_zeros(x)
        x &= x - _U64(1)
        r = before + np.int64(_popcount(members & ((_U64(1) << p) - _U64(1))))
        gaps[c, k] = _U64(r - last - 1)
        last = r
        i = base + np.int64(p)
        a = _U64(old[i])
        b = _U64(new[i])
        if floating:
            a = _nb_key(a, sign, full, shift)
            b = _nb_key(b, sign, full, shift)
        s = (b - a) & full
        steps[c, k] = ((s << _U64(1)) & full) ^ ((_U64(0) - (s >> shift)) & full)
        k += 1
    return k, last


@kernel()
def nb_scan(old, new, t1, t2, mask, top, floating, sign, full, gaps, steps, counts):  # pragma: no cover
    """One pass over a tensor: for each changed element, its class (``top`` minus the number of
    thresholds its old magnitude is below) and its rank within the class, written class by class
    as Rice gaps (``gaps[c, :counts[c]]``, the elements of the class skipped since the previous
    change) and zigzag coded steps (``steps[c, ...]``). Works on words of 64 elements: bit masks of
    the changed elements and of the elements below each threshold (vectorised), then popcounts
    give the ranks. Elements below t1 are class ``top - 2``, below t2 only ``top - 1``, the rest
    ``top``; classes below 0 have no members (their thresholds are 0). Returns False, having
    stopped early, if a class has more changes than the arrays have room for."""
    n = old.size
    cap = gaps.shape[1]
    shift = _U64(8 * old.itemsize - 1)
    k0 = k1 = k2 = 0
    last0 = last1 = last2 = -1
    c1 = 0  # elements so far below t1
    c2 = 0  # ... below t2
    full_words = n // 64
    for w in range(full_words + 1):
        base = w * 64
        size = min(64, n - base)
        d = _U64(0)
        m1 = _U64(0)
        m2 = _U64(0)
        if size == 64:
            for b in range(64):
                a = old[base + b]
                m = a & mask
                d |= _U64(a != new[base + b]) << _U64(b)
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2
        else:
            for b in range(size):
                a = old[base + b]
                m = a & mask
                d |= _U64(a != new[base + b]) << _U64(b)
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2 & ((_U64(1) << _U64(size)) - _U64(1))
        if d:
            mid = m2 & ~m1
            if (k0 + np.int64(_popcount(d & m1)) > cap or k1 + np.int64(_popcount(d & mid)) > cap
                    or k2 + np.int64(_popcount(d & rest)) > cap):
                return False
            if d & m1:
                k0, last0 = _nb_emit(old, new, d & m1, m1, c1, base, top - 2, gaps, steps, k0, last0,
                                     floating, sign, full, shift)
            if d & mid:
                k1, last1 = _nb_emit(old, new, d & mid, mid, c2 - c1, base, top - 1, gaps, steps, k1, last1,
                                     floating, sign, full, shift)
            if d & rest:
                k2, last2 = _nb_emit(old, new, d & rest, rest, base - c2, base, top, gaps, steps, k2, last2,
                                     floating, sign, full, shift)
        c1 += np.int64(_popcount(m1))
        c2 += np.int64(_popcount(m2))
    if top >= 2:
        counts[top - 2] = k0
    if top >= 1:
        counts[top - 1] = k1
    counts[top] = k2
    return True


def _select_table() -> np.ndarray:
    """``[byte * 8 + r]``: the position of the r-th set bit of ``byte``."""
    table = np.zeros(256 * 8, dtype=np.uint8)
    for byte in range(256):
        for r, bit in enumerate(b for b in range(8) if byte >> b & 1):
            table[byte * 8 + r] = bit
    return table


_SELECT8 = _select_table()
_L8 = np.uint64(0x0101010101010101)
_NO_RANK = 1 << 62  # a rank never reached
_H8 = np.uint64(0x8080808080808080)


@kernel()
def nb_select(x, r):  # pragma: no cover - compiled
    """Position of the ``r``-th (from 0) set bit of ``x``, which has more than ``r`` set bits
    (broadword select: byte popcounts, their prefix sums by a multiply, the byte by a SWAR compare,
    then a table)."""
    s = x - ((x >> _U64(1)) & _U64(0x5555555555555555))
    s = (s & _U64(0x3333333333333333)) + ((s >> _U64(2)) & _U64(0x3333333333333333))
    s = (s + (s >> _U64(4))) & _U64(0x0F0F0F0F0F0F0F0F)
    prefix = s * _L8  # byte i: set bits in bytes 0..i
    ru = _U64(r)
    # Bytes whose prefix is <= r: those wholly before the wanted bit.
    le = ((((ru * _L8) | _H8) - prefix) & _H8) >> _U64(7)
    byte = (le * _L8) >> _U64(56)
    shift = byte * _U64(8)
    before = ((prefix << _U64(8)) >> shift) & _U64(0xFF)
    bits = (x >> shift) & _U64(0xFF)
    return np.int64(shift) + np.int64(_SELECT8[np.int64(bits) * 8 + np.int64(ru - before)])


@kernel(inline="always")
def _nb_hits(old, out, x, first, base, ranks, steps, ptr, end, target, floating, sign, full, shift):  # pragma: no cover
    """Move the changed members of one level in a word: ``x`` its members there, ``first`` the
    level's members before the word, ``target`` the next rank wanted (at ``ptr`` in ``ranks``)."""
    upto = first + np.int64(_popcount(x))
    while target < upto:
        i = base + nb_select(x, target - first)
        a = _U64(old[i])
        z = steps[ptr]
        s = (z >> _U64(1)) ^ ((_U64(0) - (z & _U64(1))) & full)
        if floating:
            out[i] = _nb_unkey((_nb_key(a, sign, full, shift) + s) & full, sign, full, shift)
        else:
            out[i] = (a + s) & full
        ptr += 1
        target = ranks[ptr] if ptr < end else _NO_RANK
    return ptr, target, upto


@kernel()
def nb_apply(old, out, t1, t2, mask, ranks, starts, steps, floating, sign, full):  # pragma: no cover
    """Copy ``old`` into ``out`` and move the changed elements. Elements fall in three *levels*
    (below t1, below t2 only, neither); ``ranks[starts[l]:starts[l+1]]`` are the increasing ranks
    within level ``l`` of its changed elements, ``steps`` (same order) their zigzag coded moves.
    Returns True when every rank was found. Works on words of 64 elements like :func:`nb_scan`;
    a hit's position in its word is a select on the level's bit mask."""
    n = old.size
    shift = _U64(8 * old.itemsize - 1)
    p0, p1, p2 = starts[0], starts[1], starts[2]
    e0, e1, e2 = starts[1], starts[2], starts[3]
    g0 = ranks[p0] if p0 < e0 else _NO_RANK
    g1 = ranks[p1] if p1 < e1 else _NO_RANK
    g2 = ranks[p2] if p2 < e2 else _NO_RANK
    s0 = s1 = s2 = 0  # level members before the current word
    full_words = n // 64
    for w in range(full_words + 1):
        base = w * 64
        size = min(64, n - base)
        m1 = _U64(0)
        m2 = _U64(0)
        if size == 64:
            for b in range(64):
                a = old[base + b]
                out[base + b] = a
                m = a & mask
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2
        else:
            for b in range(size):
                a = old[base + b]
                out[base + b] = a
                m = a & mask
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2 & ((_U64(1) << _U64(size)) - _U64(1))
        p0, g0, s0 = _nb_hits(old, out, m1, s0, base, ranks, steps, p0, e0, g0, floating, sign, full, shift)
        p1, g1, s1 = _nb_hits(old, out, m2 & ~m1, s1, base, ranks, steps, p1, e1, g1, floating, sign, full, shift)
        p2, g2, s2 = _nb_hits(old, out, rest, s2, base, ranks, steps, p2, e2, g2, floating, sign, full, shift)
    return p0 == e0 and p1 == e1 and p2 == e2


@kernel()
def nb_rice_k(gaps):  # pragma: no cover - compiled
    """The Rice parameter that minimises the exact coded size of ``gaps`` (tried around the one
    a geometric distribution of the same mean wants), and the unary stream's length in bits."""
    n = gaps.size
    total = 0.0
    for i in range(n):
        total += gaps[i]
    mean = total / n
    centre = int(np.log2(mean * np.log(2.0) + 1.0)) if mean > 0 else 0
    lo = min(max(0, centre - 2), 57)
    s0 = s1 = s2 = s3 = s4 = _U64(0)
    k0, k1, k2, k3, k4 = _U64(lo), _U64(lo + 1), _U64(lo + 2), _U64(lo + 3), _U64(lo + 4)
    for i in range(n):
        g = gaps[i]
        s0 += g >> k0
        s1 += g >> k1
        s2 += g >> k2
        s3 += g >> k3
        s4 += g >> k4
    sums = np.array([s0, s1, s2, s3, s4], dtype=np.uint64)
    best = 0
    for j in range(1, 5):
        if n * (lo + j + 1) + np.int64(sums[j]) < n * (lo + best + 1) + np.int64(sums[best]):
            best = j
    return lo + best, n + np.int64(sums[best])


@kernel()
def nb_rice_encode(gaps, k, unary, low):  # pragma: no cover - compiled
    """Rice code into two zeroed little-endian uint64 word buffers (see :func:`.sparse.rice_encode`)."""
    ub = 0
    lb = 0
    lowmask = (_U64(1) << _U64(k)) - _U64(1)
    for i in range(gaps.size):
        g = gaps[i]
        ub += np.int64(g >> _U64(k))
        unary[ub >> 6] |= _U64(1) << _U64(ub & 63)
        ub += 1
        if k:
            r = g & lowmask
            w = lb >> 6
            o = lb & 63
            low[w] |= r << _U64(o)
            if o + k > 64:
                low[w + 1] |= r >> _U64(64 - o)
            lb += k
    return ub, lb


@kernel()
def nb_rice_decode(unary, ubytes, low, k, count, limit, as_ranks, out):  # pragma: no cover - compiled
    """Inverse of :func:`nb_rice_encode`, reading the streams as zero-padded little-endian uint64
    words (``ubytes``: the unary stream's real length in bytes): 0 when ``out`` holds exactly
    ``count`` values (gaps, or with ``as_ranks`` the running ranks, each below ``limit``), else an
    error code: 1 too few codes, 2 trailing bits, 3 value out of range."""
    nwords = unary.size
    w = 0
    cur = unary[0]
    end = -1  # position of the previous code's terminating 1 bit
    lb = 0
    prev = -1
    qmax = np.int64(1) << np.int64(62 - k)
    lowmask = (_U64(1) << _U64(k)) - _U64(1)
    for i in range(count):
        while cur == 0:
            w += 1
            if w >= nwords:
                return 1
            cur = unary[w]
        pos = w * 64 + np.int64(_trailing_zeros(cur))
        cur &= cur - _U64(1)
        q = pos - end - 1
        end = pos
        if q > qmax:
            return 3
        g = q << k
        if k:
            lw = lb >> 6
            o = lb & 63
            r = low[lw] >> _U64(o)
            if o + k > 64:
                r |= low[lw + 1] << _U64(64 - o)
            g |= np.int64(r & lowmask)
            lb += k
        if as_ranks:
            if g >= limit:
                return 3
            prev += g + 1
            if prev >= limit:
                return 3
            out[i] = prev
        else:
            out[i] = g
    # Nothing but zero padding may follow the last code, within its byte.
    if (end + 8) >> 3 != ubytes:
        return 2
    if cur:
        return 2
    for v in range(w + 1, nwords):
        if unary[v]:
            return 2
    return 0


@kernel()
def nb_split_steps(steps, signs, mags, escapes):  # pragma: no cover - compiled
    """Zigzag steps ``z`` (all >= 1) -> ``u = z - 1``: its low bit into the bit stream ``signs``,
    ``m = u >> 1`` into 2-bit fields of ``mags`` (four per byte), ``m - 3`` into ``escapes`` where
    ``m >= 3`` (field 3). Returns the number of escapes. Works on blocks of 32 steps, whose sign
    and field bits are gathered in two words."""
    n = steps.size
    e = 0
    for start in range(0, n, 32):
        stop = min(start + 32, n)
        sw = _U64(0)
        mw = _U64(0)
        for i in range(start, stop):
            u = _U64(steps[i]) - _U64(1)
            j = _U64(i - start)
            sw |= (u & _U64(1)) << j
            m = u >> _U64(1)
            if m >= _U64(3):
                escapes[e] = m - _U64(3)
                e += 1
                m = _U64(3)
            mw |= m << (j + j)
        for q in range((stop - start + 7) >> 3):
            signs[(start >> 3) + q] = np.uint8((sw >> _U64(8 * q)) & _U64(0xFF))
        for q in range((stop - start + 3) >> 2):
            mags[(start >> 2) + q] = np.uint8((mw >> _U64(8 * q)) & _U64(0xFF))
    return e


@kernel()
def nb_count_escapes(mags, n):  # pragma: no cover - compiled
    e = 0
    for i in range(n):
        e += ((mags[i >> 2] >> (2 * (i & 3))) & 3) == 3
    return e


@kernel()
def nb_join_steps(signs, mags, escapes, limit, out):  # pragma: no cover - compiled
    """Inverse of :func:`nb_split_steps` into ``out`` (uint64): 0, or 1 if the escapes do not
    match, 2 if a step exceeds ``limit`` (all bits of the element width), 3 if padding bits are
    set."""
    e = 0
    n = out.size
    half = limit >> _U64(1)
    for start in range(0, n, 32):
        stop = min(start + 32, n)
        sw = _U64(0)
        mw = _U64(0)
        for q in range((stop - start + 7) >> 3):
            sw |= _U64(signs[(start >> 3) + q]) << _U64(8 * q)
        for q in range((stop - start + 3) >> 2):
            mw |= _U64(mags[(start >> 2) + q]) << _U64(8 * q)
        for i in range(start, stop):
            j = _U64(i - start)
            m = (mw >> (j + j)) & _U64(3)
            if m == _U64(3):
                if e >= escapes.size:
                    return 1
                x = _U64(escapes[e])
                e += 1
                if x > half:
                    return 2
                m = x + _U64(3)
                if m > half:
                    return 2
            u = (m << _U64(1)) + ((sw >> j) & _U64(1))
            if u >= limit:
                return 2
            out[i] = u + _U64(1)
    if e != escapes.size:
        return 1
    if n & 7 and signs[n >> 3] >> (n & 7):
        return 3
    if n & 3 and mags[n >> 2] >> (2 * (n & 3)):
        return 3
    return 0
