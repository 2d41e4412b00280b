"""The ``elastic-np`` command-line tool."""

import argparse
import sys

import numpy as np

from elastic_np import reference


def _example(args):
    """Evaluate the oracles on a small worked example and print the results."""
    np.set_printoptions(precision=6, suppress=True)
    x = np.array([-1.0, 0.0, 1.0, 2.0])
    print("logits x                         ", x)
    print("softmax(x)                       ", reference.softmax(x))
    print("online_softmax(x, block_size=3)  ", reference.online_softmax(x, block_size=3))
    print("nvm(x)                           ", reference.nvm(x))
    print("elastic_softmax(x, tau=0.5, beta=1)", reference.elastic_softmax(x, tau=0.5, beta=1.0))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    out, lse = reference.attention(q, k, v, causal=True, nvm=True, tau=0.5, beta=1.0)
    print("attention(causal, nvm, tau=0.5, beta=1): out[0, 0, :, :3] =")
    print(out[0, 0, :, :3])
    print("lse[0, 0] =", lse[0, 0])
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="elastic-np",
        description="Float64 oracles and fast kernels for Elastic-Softmax attention.",
    )
    sub = parser.add_subparsers(dest="command")
    example = sub.add_parser("example", help="evaluate the oracles on a worked example")
    example.set_defaults(func=_example)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["example"])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
