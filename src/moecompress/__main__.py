"""`python -m moecompress VERB ...`: the `moecompress` command."""

from .cli import main

if __name__ == "__main__":
    main()
