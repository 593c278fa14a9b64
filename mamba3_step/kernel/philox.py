"""Stochastic rounding's random bits on the device (mamba3_step.rounding): Philox4x32-10, its key and
counter words per token (or per replayed ring entry, as its step drew), and the row a token's draws
are for.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Token
from ..rounding import PHILOX_M, PHILOX_W

__all__ = ["RandomBits"]


class RandomBits:
    """The random words of stochastic rounding (a mixin of the kernel class)."""

    @cute.jit
    def rng_source(self, m: KernelArgs, b: Int32) -> tuple:
        """``(seed, offset, row)``: rand_seed's two int64 values and, in dense mode with
        ``rand_rows``, the row lane ``b`` draws for (else None: the row written, ``cta.dst``)."""
        row = m.rand_rows[b] if const_expr(self.spec.has_rand_rows) else None
        return (m.rand_seed[0], m.rand_seed[1], row)

    @cute.jit
    def token_rng(self, seed_offset: tuple, t: int) -> tuple:
        """``(k0, k1, o0, o1)``: the seed's and token ``t``'s offset's (``offset + t``) 32-bit words."""
        return self.rng_words(seed_offset[0], seed_offset[1] + Int64(t))

    @cute.jit
    def ring_rng(self, m: KernelArgs, j: int, cta: Cta) -> tuple:
        """``(k0, k1, o0, o1, row)``: a replayed ring entry's draws, as its step drew them: the seed's
        words, the entry's recorded offset's, and the row it drew for."""
        return self.rng_words(cta.seed[0], m.ring_offset[cta.src, j, cta.h]) + (m.ring_drawn_for[cta.src, j, cta.h],)

    def rng_words(self, seed: Int64, offset: Int64) -> tuple:
        """``(k0, k1, o0, o1)``: the 32-bit words of the seed (Philox's key) and of an offset."""
        return (Uint32(seed), Uint32(Uint64(seed) >> 32), Uint32(offset), Uint32(Uint64(offset) >> 32))

    def draw_row(self, tok: Token, cta: Cta):
        """The row a token's draws are for: a replayed entry's recorded one, else the lane's
        ``rand_rows`` entry (dense mode), else the row its state is stored to."""
        if len(tok.rng) > 4:
            return tok.rng[4]
        return cta.dst if cta.seed[2] is None else cta.seed[2]

    def philox(self, counter: tuple, k0: Uint32, k1: Uint32) -> list:
        """Philox4x32-10 (Random123): four Uint32 words of ``counter`` under the key ``(k0, k1)``."""
        c0, c1, c2, c3 = counter
        for _ in range(10):
            p0 = Uint64(c0) * Uint64(PHILOX_M[0])
            p1 = Uint64(c2) * Uint64(PHILOX_M[1])
            c0, c1, c2, c3 = (Uint32(p1 >> 32) ^ c1 ^ k0, Uint32(p1), Uint32(p0 >> 32) ^ c3 ^ k1, Uint32(p0))
            k0, k1 = k0 + Uint32(PHILOX_W[0]), k1 + Uint32(PHILOX_W[1])
        return [c0, c1, c2, c3]
