"""``python -m elastic_np.cuda``: see `elastic_np.cuda._cli.main`."""

from elastic_np.cuda._cli import main

if __name__ == "__main__":
    main()
