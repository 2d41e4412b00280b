from elastic_np.cli import main

raise SystemExit(main())
