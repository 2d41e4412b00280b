"""``python -m elastic_np.cuda``: the entry script of the CUDA tool, `elastic_np.cli._cuda.main`.

A script, not a module of the backend: nothing in `elastic_np.cuda` imports it.
"""

from elastic_np.cli._cuda import main

if __name__ == "__main__":
    main()
