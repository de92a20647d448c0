"""The order in which a Triton GEMM's programs take their output tiles: GROUP_M rows of tiles
at a time, column by column, so that the programs running together share rows of A and
columns of B in L2."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row, column) of program ``pid``'s tile in a grid of tiles_m x tiles_n tiles."""
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m
