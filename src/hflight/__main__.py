"""``python -m hflight [overrides]``: the same command as ``hflight-train`` (see :mod:`hflight.cli`)."""

from hflight.cli import main

if __name__ == "__main__":
    main()
