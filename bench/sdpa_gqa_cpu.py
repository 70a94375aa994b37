"""Grouped-query attention on the CPU: SDPA grouping the heads itself (enable_gqa) against k and v
copied to whole heads, at SmolLM2-135M's shapes (9 query heads, 3 key/value heads, head dim 64),
batch 16 x 129 positions, fp32, causal without a mask and with a boolean padding mask; forward, and
forward + backward. The fastest of 10 alternating rounds of 10 calls (5 for forward + backward), in ms.
capt.models.llama.native_gqa chooses enable_gqa on the CPU from these figures (docs/speed.md).

    python bench/sdpa_gqa_cpu.py
"""

import time

import torch
import torch.nn.functional as F


def fastest_of_two(a, b, calls: int, rounds: int) -> tuple[float, float]:
    """ms per call of a and of b, each the fastest of `rounds` rounds of `calls` calls; the rounds
    alternate between a and b, so that a busy machine slows both alike."""
    a(), b()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((a, b)):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t) / calls)
    return 1e3 * best[0], 1e3 * best[1]


def main() -> None:
    B, H, Hkv, T, Dh = 16, 9, 3, 129, 64
    groups = H // Hkv
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, Dh, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, T, Dh, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, T, Dh, generator=g, requires_grad=True)
    mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    mask[:4, :, :, :10] = False  # four left-padded rows
    mask |= torch.eye(T, dtype=torch.bool)  # every query sees itself (as capt.models.llama.sdpa_mask makes it)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B {B}, heads {H}/{Hkv}, T {T}, Dh {Dh}, "
          "fp32; ms")
    for name, kwargs in (("causal, no mask", dict(is_causal=True)), ("boolean mask", dict(attn_mask=mask))):
        def grouped():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)

        def copied():
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **kwargs
            )

        torch.testing.assert_close(grouped(), copied())
        with torch.no_grad():
            fwd = fastest_of_two(grouped, copied, 10, 10)
        both = fastest_of_two(lambda: grouped().sum().backward(), lambda: copied().sum().backward(), 5, 10)
        print(f"{name:<16} forward: enable_gqa {fwd[0]:.1f}, copied heads {fwd[1]:.1f};  "
              f"forward + backward: enable_gqa {both[0]:.1f}, copied heads {both[1]:.1f}")


if __name__ == "__main__":
    main()
