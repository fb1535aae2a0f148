"""Load balance of causal attention tile orders on one CTA per SM, simulated (CPU only, no kernel runs): the numbers
behind cuda_src/attention/sm90/tile_scheduler.cuh's choice of equal-cost m-block pairs for the persistent FA3 kernel.

    python3 bench/experiments/flash_fwd/tile_order_sim.py [--sms 132]

Cost model: a 128-row tile at m-block m of a causal L = S call visits m + 1 key blocks, plus a fixed ½ block for its
prologue and epilogue. Printed per shape: makespan / ideal (ideal = total cost / SMs) for
  * hw-order   the one-tile launch: blocks in launch order (m-blocks of a head longest first, head after head), each
               taken by the first free SM (greedy list scheduling; what the hardware block scheduler does);
  * greedy-lpt every tile sorted longest first, each to the first free SM (a dynamic atomic-counter scheduler);
  * stride     static striding (tile = cta + i·SMs) over the hw-order sequence (a persistent kernel without pairs);
  * pairs      static striding over units of m-blocks (M−1−k, k) of one head (tile_scheduler.cuh, tile_pairs = 1).
Simulated, not measured: real tiles also differ by L2 hits, and the per-tile overhead is a guess.
"""
import argparse
import heapq
import math

SHAPES = ((2, 16, 8192), (1, 32, 32768), (8, 16, 2048), (4, 32, 4096), (16, 16, 1024), (1, 16, 4096), (2, 8, 2048),
          (1, 24, 2048))
OVERHEAD = 0.5


def greedy(costs, sms):
    """Makespan when each cost in order goes to the first free SM."""
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def static(costs, ctas):
    """Makespan when unit i goes to CTA i % ctas."""
    load = [0.0] * ctas
    for i, c in enumerate(costs):
        load[i % ctas] += c
    return max(load)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    sms = ap.parse_args().sms
    print(f"{sms} SMs, causal L = S, cost = key blocks + {OVERHEAD} per tile; makespan / ideal")
    print(f"{'(B, H, L)':16s} {'tiles':>6s} {'hw-order':>9s} {'greedy-lpt':>11s} {'stride':>7s} {'pairs':>6s}")
    for B, H, L in SHAPES:
        M = math.ceil(L / 128)
        per_head = [m + 1 + OVERHEAD for m in reversed(range(M))]
        hw = per_head * (B * H)
        pairs = [(M - k) + (k + 1) + 2 * OVERHEAD if k < M - 1 - k else (k + 1) + OVERHEAD
                 for _ in range(B * H) for k in range((M + 1) // 2)]
        ideal = sum(hw) / sms
        print(f"{str((B, H, L)):16s} {len(hw):6d} {greedy(hw, sms) / ideal:9.3f} "
              f"{greedy(sorted(hw, reverse=True), sms) / ideal:11.3f} {static(hw, sms) / ideal:7.3f} "
              f"{static(pairs, min(sms, len(pairs))) / ideal:6.3f}")


if __name__ == "__main__":
    main()
