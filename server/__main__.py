import os
import sys

# transformers (the tokenizers) warns at import that PyTorch was not found, which a server
# never needs: an advisory warning, which this variable silences (before its first import)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jpaged.engine import heap  # noqa: E402

# flax asks whether it runs inside IPython by importing it (0.2 s where it is installed); a
# server never does: the import fails at once while the server's modules load.
sys.modules.setdefault("IPython", None)  # type: ignore[arg-type]
with heap.importing():
    from server.cli import main
if sys.modules["IPython"] is None:
    del sys.modules["IPython"]

if __name__ == "__main__":  # (not in an engine process, which imports this module again)
    main()
