"""``python -m elastic_np``: the ``elastic-np`` command-line tool."""

from elastic_np.cli import main

raise SystemExit(main())
