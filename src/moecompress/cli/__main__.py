"""`python -m moecompress.cli VERB ...`: what `torchrun` and `accelerate launch -m` start."""

from . import main

if __name__ == "__main__":
    main()
