"""A worked Gagar example: one graded group through the three redistribution modes.

Run: `.venv/bin/python scripts/gagar_example.py`
"""

import numpy as np

from gagar_jax import advantages as adv


def main():
    # One task, 8 rollouts: 4 pass the tests, one of them a confirmed cheat (it read a leaked
    # answer), 4 fail. The grader ranks the 3 honest passes: a minimal fix (T1), an over-broad
    # but correct fix (T2) and a sprawling fix with side effects (T3).
    rewards = np.array([[1, 1, 1, 1, 0, 0, 0, 0]], np.float32)
    cheat = np.array([[0, 0, 0, 1, 0, 0, 0, 0]], bool)
    tier = np.array([[1, 2, 3, 1, 1, 1, 1, 1]], np.int32)
    rank = np.array([[1, 2, 3, 1, 1, 1, 1, 1]], np.int32)
    valid = np.ones_like(rewards, bool)
    graded = np.array([True])
    np.set_printoptions(precision=4, suppress=True, floatmode="fixed")
    print("rewards        ", rewards[0], " (rollout 3 is a confirmed cheat)")
    print("tiers (passing)", tier[0][:3])
    for mode in ("none", "discount_only", "sum_preserving"):
        out = adv.gagar_advantages(
            rewards,
            rewards > 0,
            cheat,
            tier,
            rank,
            graded,
            valid,
            config=adv.GagarConfig(mode=mode),
        )
        m = {k: float(v) for k, v in out.metrics.items()}
        print(f"\nmode={mode}")
        print("  advantages   ", np.asarray(out.advantages)[0])
        print(
            f"  positive {m['credit/positive']:+.4f}  negative {m['credit/negative']:+.4f}  "
            f"ratio {m['credit/ratio']:.4f}  moved {m['credit/moved']:.4f}  "
            f"conservation error {m['credit/max_conservation_error']:.1e}"
        )
    print("\nAfter the cheat penalty the group has 3 passes in 8 (mean 0.375): each pass starts")
    print("at A = 0.625, each failure at -0.375. Factors (1.0, 0.6, 0.3) have mean 0.6333, so")
    print("Gagar gives 0.625 * f / 0.6333 = 0.9868, 0.5921, 0.2961: the positive total 1.875 and")
    print("the failed side are kept. Discount-only keeps 1.19 of 1.875 (ratio 0.63): the imbalance")
    print("that destabilised training in the paper's ablation.")


if __name__ == "__main__":
    main()
