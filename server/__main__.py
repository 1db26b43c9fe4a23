import sys

from jpaged.engine import heap

# flax asks whether it runs inside IPython by importing it (0.2 s where it is installed); a
# server never does: the import fails at once while the server's modules load.
sys.modules.setdefault("IPython", None)  # type: ignore[arg-type]
with heap.importing():
    from server.cli import main
if sys.modules["IPython"] is None:
    del sys.modules["IPython"]

main()
