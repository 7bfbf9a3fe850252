"""`python -m loomtrain ...` (also what torchrun runs: `torchrun ... -m loomtrain train CONFIG`)."""

from loomtrain.launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
