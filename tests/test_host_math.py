"""lowering/host_math.py: the host's launch arithmetic gives Triton's own values."""
import triton

from sloth.lowering.host_math import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    for n in range(-3, 1 << 16):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for a in range(0, 3000, 7):
        for b in (1, 2, 3, 16, 64, 100, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
